"""A kernel small enough to ask whether the installed triton can compile for a target at all."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omniinfer.kernels.triton.catalogue import KernelLaunch


@triton.jit
def _probe_kernel(x_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets) + 1)


def _launch() -> None:
    _probe_kernel[(1,)](torch.empty(16, device="meta"), BLOCK=16)


LAUNCH = KernelLaunch("probe", "fp32 x16", None, _launch)
