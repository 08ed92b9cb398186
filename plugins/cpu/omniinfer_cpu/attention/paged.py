"""CPU_PAGED: the CPU plugin's compiled paged attention (``omni_paged_attention``).

One call per layer writes the step's keys and values into the cache and attends every query
token of the batch (prompts, chunks after a cached context, decodes) over its sequence's
cached keys, read in place through the block table: no per-step gather of the cache and no
Python loop over sequences. Work is split across threads by (sequence, tile of up to 16 query
tokens, and KV head when there are too few sequences to keep the threads busy); an item reads
each key once for all its query rows (tokens x the query heads sharing the KV head), 16 keys at a
time, prefetches the next chunks into L2, and runs an online softmax in float32.

The cache has its own layout, ``[2, blocks, kv_heads, block_size, head]``: one head's tile of a
block is contiguous, and the keys inside it are stored transposed (packed by pairs of components
in bfloat16) so that 16 keys' scores are one vector of multiply-adds (``vdpbf16ps`` in bfloat16).
Refused, with the reason, when the kernels are unavailable (the next preference, TORCH_SDPA,
serves then).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from omniinfer.attention.backend import AttentionBackend, AttentionImpl, AttentionSpec
from omniinfer_cpu.kernels import build

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_SIZE = 256
MAX_GROUP = 64  # query heads per KV head


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def kernel_metadata(metadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot_mapping int64, block_tables int32 with unit column stride, query_start_loc int32,
    seq_lens int32), each contiguous, as omni_paged_attention reads them."""
    slots = metadata.slot_mapping
    if slots.dtype != torch.int64:
        slots = slots.long()
    tables = metadata.block_tables
    if tables.dtype != torch.int32 or tables.stride(-1) != 1:
        tables = tables.to(torch.int32).contiguous()
    qsl, seq_lens = metadata.query_start_loc, metadata.seq_lens_tensor
    if qsl.dtype != torch.int32:
        qsl = qsl.to(torch.int32)
    if seq_lens.dtype != torch.int32:
        seq_lens = seq_lens.to(torch.int32)
    return slots.contiguous(), tables, qsl.contiguous(), seq_lens.contiguous()


class CpuPagedImpl(AttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        kernels = build.load()
        if kernels is None:
            raise RuntimeError(f"CPU_PAGED needs the CPU kernels: {build.unavailable_reason()}")
        self.kernel = kernels.paged_attention

    def forward(self, query, key, value, kv_cache, metadata):
        num_tokens, dtype = query.shape[0], query.dtype
        out = torch.empty(num_tokens, self.num_heads * self.head_size, dtype=kv_cache.dtype)
        if num_tokens == 0:
            return out.to(dtype)
        query, key, value = _row_major(query), _row_major(key), _row_major(value)
        slots, tables, qsl, seq_lens = kernel_metadata(metadata)
        if kv_cache.dtype != dtype:  # the kernel computes in the cache's dtype
            query, key, value = (t.to(kv_cache.dtype) for t in (query, key, value))
        result = self.kernel(
            query.data_ptr(), query.stride(0), key.data_ptr(), key.stride(0), value.data_ptr(),
            value.stride(0), slots.data_ptr(), num_tokens, kv_cache[0].data_ptr(),
            kv_cache[1].data_ptr(), tables.data_ptr(), tables.stride(0), qsl.data_ptr(),
            seq_lens.data_ptr(), len(metadata.seq_lens), out.data_ptr(), out.stride(0),
            self.num_heads, self.num_kv_heads, self.head_size, kv_cache.shape[3], self.scale,
            self.sliding_window or 0, DTYPE_CODES[kv_cache.dtype], torch.get_num_threads())
        if result != 0:
            raise RuntimeError(f"omni_paged_attention failed ({result})")
        return out.to(dtype)


class CpuPagedBackend(AttentionBackend):
    name: ClassVar[str] = "CPU_PAGED"
    supported_device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = tuple(DTYPE_CODES)
    supports_window_pool: ClassVar[bool] = True

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        """[2, blocks, kv_heads, block_size, head]; inside each head's tile the keys are stored
        transposed: component d of token o at [d // x][o][d % x], x = 1 (float32) or 2 (bfloat16)."""
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if spec.head_size > MAX_HEAD_SIZE:
            reasons.append(f"head size {spec.head_size} > {MAX_HEAD_SIZE}")
        if spec.dtype == torch.bfloat16 and spec.head_size % 2:
            reasons.append(f"odd head size {spec.head_size} in bfloat16 (keys are stored in pairs)")
        if spec.num_heads // max(1, spec.num_kv_heads) > MAX_GROUP:
            reasons.append(f"more than {MAX_GROUP} query heads per KV head")
        if build.load() is None:
            reasons.append(f"the CPU kernels are unavailable: {build.unavailable_reason()}")
        return reasons

    @classmethod
    def get_impl_cls(cls):
        return CpuPagedImpl
