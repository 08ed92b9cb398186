"""Portable Triton kernels: the paged KV cache's write and attention, quantized GEMMs (GGUF
blocks among them), fused MoE.

Importing this package does not import triton; :func:`unavailable_reasons` answers whether the
kernels can run on a device type, and the kernels live in :mod:`.reshape_and_cache`,
:mod:`.paged_attention`, :mod:`.quant_gemm` (with :mod:`.wn_gemv`), :mod:`.int8_gemm` (with
:mod:`.int8_gemv`), :mod:`.gguf_gemm` (with :mod:`.gguf_gemv` and :mod:`.gguf_kgemv`),
:mod:`.fp8_gemm`, :mod:`.dequant_linear` (the quantized layers' products by rows) and
:mod:`.fused_moe` (importing those imports triton).

Triton decides between compiling for a GPU and interpreting on the CPU when a kernel is
*defined*, from ``TRITON_INTERPRET``: set ``TRITON_INTERPRET=1`` before the first import of the
kernel modules to run them on CPU tensors (tests and debugging; 600-3000x slower than torch).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

ENV_INTERPRET = "TRITON_INTERPRET"
_KERNEL_MODULES = ("omniinfer.kernels.triton.paged_attention",
                   "omniinfer.kernels.triton.reshape_and_cache",
                   "omniinfer.kernels.triton.wn_gemv",
                   "omniinfer.kernels.triton.quant_gemm",
                   "omniinfer.kernels.triton.int8_gemv",
                   "omniinfer.kernels.triton.int8_gemm",
                   "omniinfer.kernels.triton.gguf_gemv",
                   "omniinfer.kernels.triton.gguf_kgemv",
                   "omniinfer.kernels.triton.gguf_gemm",
                   "omniinfer.kernels.triton.fp8_gemm",
                   "omniinfer.kernels.triton.dequant_linear",
                   "omniinfer.kernels.triton.fused_moe")


def interpret_requested() -> bool:
    return os.environ.get(ENV_INTERPRET, "0").strip().lower() in ("1", "true", "on", "yes")


def unavailable_reasons(device_type: str) -> list[str]:
    """Why the kernels cannot run on `device_type` here (empty: they can). Cheap after the first call."""
    if importlib.util.find_spec("triton") is None:
        return ["triton is not installed (pip install 'triton>=3.0')"]
    try:
        importlib.import_module("triton")
    except Exception as e:  # a broken install must read as a refusal, not a crash
        return [f"triton does not import: {type(e).__name__}: {e}"]
    loaded = [sys.modules[m] for m in _KERNEL_MODULES if m in sys.modules]
    compiled = [m for m in loaded if not getattr(m, "INTERPRETED", False)]
    interpreted = [m for m in loaded if getattr(m, "INTERPRETED", False)]
    if device_type == "cpu":
        if not interpret_requested() and not interpreted:
            return [f"on the CPU triton runs only under its interpreter: set {ENV_INTERPRET}=1 "
                    "before start (slow; for tests and debugging)"]
        if compiled:
            return [f"the triton kernels were already loaded for a GPU ({ENV_INTERPRET} was set "
                    "after they were imported); set it before start"]
        return []
    if interpreted or (interpret_requested() and not loaded):
        return [f"{ENV_INTERPRET}=1 makes triton interpret the kernels on the host; unset it to "
                f"run them compiled on {device_type}"]
    return []
