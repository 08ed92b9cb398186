"""TRITON: the core's portable Triton kernels (NVIDIA, AMD, Intel; the CPU under the interpreter).

The step's keys and values are written first (slot -1 writes nothing); prefill chunks then
attend over their paged context and themselves in one launch, and decodes in another launch
that reads only device tensors (so CUDA/HIP graphs can replay it).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from omniinfer.attention.backend import AttentionBackend, AttentionSpec, StagedAttentionImpl

MAX_HEAD_SIZE = 256
# the launch functions below, as the kernel catalogue and its refusal table name them
WRITE, DECODE, PREFILL = "reshape_and_cache", "paged_decode_attention", "paged_prefill_attention"


def triton_reasons(spec: AttentionSpec, ops: tuple[str, ...] = (WRITE, DECODE, PREFILL)
                   ) -> list[str]:
    """Why the core Triton kernels cannot run `ops` for `spec` (shared by every backend built on
    them): triton missing, a GPU below the floor, or what the ahead-of-time check found this
    device's architecture cannot run (kernels/triton/refusals.py; nothing compiles here)."""
    from omniinfer.kernels.triton import unavailable_reasons
    from omniinfer.kernels.triton.refusals import refusal_reasons

    reasons = unavailable_reasons(spec.device_type)
    if spec.head_size > MAX_HEAD_SIZE:
        reasons.append(f"head size {spec.head_size} > {MAX_HEAD_SIZE} (the kernels keep a head in registers)")
    capability, floor = spec.device_capability, spec.min_triton_capability
    if capability is not None and floor is not None and capability < floor:
        reasons.append(f"triton needs compute capability {floor[0]}.{floor[1]}+, this GPU has "
                       f"{capability[0]}.{capability[1]}")
    return reasons + refusal_reasons(spec, ops)


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Triton cache write for the default [2, blocks, block_size, kv_heads, head] layout."""
    from omniinfer.kernels.triton.reshape_and_cache import reshape_and_cache

    reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slot_mapping)


def decode(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, md, scale: float,
           sliding_window: int | None) -> None:
    """Triton paged decode over `md` (the decode part); graph-safe."""
    from omniinfer.kernels.triton.paged_attention import paged_decode_attention

    paged_decode_attention(out, query, kv_cache[0], kv_cache[1], md.block_tables,
                           md.seq_lens_tensor, scale, sliding_window)


def prefill(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, md, scale: float,
            sliding_window: int | None) -> None:
    """Triton prefill over a paged prefix for `md` (the prefill part)."""
    from omniinfer.kernels.triton.paged_attention import paged_prefill_attention

    paged_prefill_attention(out, query, kv_cache[0], kv_cache[1], md.block_tables,
                            md.seq_lens_tensor, md.query_start_loc, md.max_query_len, scale,
                            sliding_window)


class TritonImpl(StagedAttentionImpl):
    def write_kv(self, key, value, kv_cache, slot_mapping):
        write_kv(key, value, kv_cache, slot_mapping)

    def prefill(self, out, query, key, value, kv_cache, metadata):
        prefill(out, query, kv_cache, metadata, self.scale, self.sliding_window)

    def decode(self, out, query, kv_cache, metadata):
        decode(out, query, kv_cache, metadata, self.scale, self.sliding_window)


class TritonBackend(AttentionBackend):
    name: ClassVar[str] = "TRITON"
    supported_device_types: ClassVar[tuple[str, ...]] = ("cuda", "xpu", "cpu")
    supports_graph_capture: ClassVar[bool] = True

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        if spec.device_type not in cls.supported_device_types:
            return []  # already said
        return triton_reasons(spec)


    @classmethod
    def get_impl_cls(cls):
        return TritonImpl
