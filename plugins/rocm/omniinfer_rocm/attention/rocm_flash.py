"""ROCM_FLASH: flash attention on AMD GPUs.

Prefill runs CK flash attention (ROCm's build of flash-attn, ``flash_attn_varlen_func`` with
upstream's signature and bottom-right causal masks) when it is importable, else the core Triton
prefill kernel over the paged prefix; cached context reaches CK through gathered key slots.
Decode always runs the core Triton paged kernel (it reads only device tensors: HIP graphs can
replay it), and the step's keys are written by the core Triton write kernel (slot -1 skipped).
"""

from __future__ import annotations

import importlib
from typing import ClassVar

import torch

from omniinfer.attention.backend import (
    AttentionBackend,
    AttentionSpec,
    PrefillKeySlotsMetadata,
    PrefillKeySlotsMetadataBuilder,
    StagedAttentionImpl,
)
from omniinfer.attention.backends import triton as triton_ops


def load_ck_varlen():
    """CK flash attention's flash_attn_varlen_func, or None when flash_attn is not importable."""
    try:
        return importlib.import_module("flash_attn").flash_attn_varlen_func
    except (ImportError, AttributeError):
        return None


class RocmFlashImpl(StagedAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ck_varlen = load_ck_varlen()
        w = self.sliding_window
        self.window_size = (w - 1, 0) if w else (-1, -1)

    def write_kv(self, key, value, kv_cache, slot_mapping):
        triton_ops.write_kv(key, value, kv_cache, slot_mapping)

    def prefill(self, out, query, key, value, kv_cache, metadata):
        if self.ck_varlen is None:
            triton_ops.prefill(out, query, kv_cache, metadata, self.scale, self.sliding_window)
        else:
            out[:] = self._ck_prefill(query, key, value, kv_cache, metadata)

    def decode(self, out, query, kv_cache, metadata):
        triton_ops.decode(out, query, kv_cache, metadata, self.scale, self.sliding_window)

    def _ck_prefill(self, q, k, v, kv_cache, md: PrefillKeySlotsMetadata) -> torch.Tensor:
        cu_q = md.query_start_loc
        cu_k, max_k = cu_q, md.max_query_len
        if md.max_prefill_context_len:
            flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)
            k, v = flat[0][md.prefill_key_slots], flat[1][md.prefill_key_slots]
            cu_k = torch.nn.functional.pad(md.seq_lens_tensor.cumsum(0), (1, 0)).to(torch.int32)
            max_k = md.max_seq_len
        return self.ck_varlen(q, k, v, cu_q, cu_k, md.max_query_len, max_k,
                              softmax_scale=self.scale, causal=True, window_size=self.window_size)


class RocmFlashBackend(AttentionBackend):
    name: ClassVar[str] = "ROCM_FLASH"
    supported_device_types: ClassVar[tuple[str, ...]] = ("cuda",)  # HIP devices are "cuda"
    supported_platforms: ClassVar[tuple[str, ...]] = ("rocm",)
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supports_graph_capture: ClassVar[bool] = True

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        ops = (triton_ops.WRITE, triton_ops.DECODE)
        if load_ck_varlen() is None:  # prefill runs the Triton kernel too
            ops += (triton_ops.PREFILL,)
        return triton_ops.triton_reasons(spec, ops)

    @classmethod
    def get_builder_cls(cls):
        return PrefillKeySlotsMetadataBuilder

    @classmethod
    def get_impl_cls(cls):
        return RocmFlashImpl
