"""FLASH_ATTN: flash-attn's varlen and KV-cache kernels over omniinfer's paged cache.

The library's contract (flash-attn 2.x, ``flash_attn_interface.py``):

* ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
  dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), ...,
  block_table=None)``: q [total_q, heads, head]; k/v [total_k, kv_heads, head], or with
  ``block_table`` [batch, max_blocks] int32 the paged caches [blocks, block_size, kv_heads,
  head]; cu_seqlens_* [batch + 1] int32. Causal masks are aligned to the bottom right (the
  last query sees the last key); ``window_size=(left, right)`` keeps keys in
  [i + sk - sq - left, i + sk - sq + right].
* ``flash_attn_with_kvcache(q, k_cache, v_cache, ..., cache_seqlens=None, ...,
  block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), ...)``:
  q [batch, seqlen_q, heads, head]; with ``block_table`` the caches are paged as above.

Upstream flash-attn refuses paged caches whose block size is not a multiple of 256 ("Paged KV
cache block size must be divisible by 256", in both functions); vLLM's fork
(``vllm_flash_attn``) accepts multiples of 16. omniinfer's block sizes go up to 128, so with
upstream flash-attn this backend reads cached context through gathered key slots for prefill
and decodes with the core Triton paged kernel; with the fork it passes the block table.
Either way the step's keys are written by the core Triton write kernel (slot -1 skipped), and
the decode path reads only device tensors, so CUDA graphs can replay it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import ClassVar

import torch

from omniinfer.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    StagedAttentionImpl,
    common_fields,
)
from omniinfer.attention.backends import triton as triton_ops
from omniinfer.attention.common import CommonAttentionMetadata
from omniinfer.kernels.triton.refusals import refusal_reasons

MIN_CAPABILITY = (8, 0)
MAX_HEAD_SIZE = 256  # flash-attn 2: head sizes that are multiples of 8, up to 256
BLOCK_SIZE_MULTIPLE = 16
# (module, block-size multiple its paged KV accepts), tried in this order
LIBRARIES = (("vllm_flash_attn", 16), ("flash_attn", 256))


@dataclass(frozen=True, slots=True)
class FlashOps:
    module_name: str
    varlen: object  # flash_attn_varlen_func
    with_kvcache: object  # flash_attn_with_kvcache
    paged_block_multiple: int

    def takes_block_table(self, block_size: int) -> bool:
        return block_size % self.paged_block_multiple == 0


def load_flash_ops() -> FlashOps:
    """The first importable flash-attention library; raises ImportError naming every attempt."""
    errors = []
    for name, multiple in LIBRARIES:
        try:
            module = importlib.import_module(name)
            return FlashOps(name, module.flash_attn_varlen_func, module.flash_attn_with_kvcache,
                            multiple)
        except (ImportError, AttributeError) as e:
            errors.append(f"{name}: {type(e).__name__}: {e}")
    raise ImportError("no flash-attention library imports (" + "; ".join(errors) + ")")


@dataclass
class FlashAttentionMetadata(AttentionMetadata):
    """Common fields plus what flash-attn's varlen contract needs."""

    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32: cumulative seq_lens (keys per sequence)
    prefill_key_slots: torch.Tensor  # [sum of prefill seq_lens] int64: cache slot of every key
    max_prefill_context_len: int  # host: longest cached context among prefills (0: none)

    def slice_fields(self, s0: int, s1: int, t0: int, t1: int) -> dict:
        cu = self.cu_seqlens_k[s0:s1 + 1]
        out = dict(cu_seqlens_k=cu - cu[0])
        if s0 > 0:
            out.update(prefill_key_slots=self.prefill_key_slots[:0], max_prefill_context_len=0)
        return out


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder):
    """The common description plus cu_seqlens_k (torch ops: it also runs on advanced steps)."""

    metadata_cls = FlashAttentionMetadata
    needs_prefill_key_slots = True

    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        cu_seqlens_k = torch.nn.functional.pad(common.seq_lens.cumsum(0), (1, 0)).to(torch.int32)
        return FlashAttentionMetadata(**common_fields(common), cu_seqlens_k=cu_seqlens_k,
                                      prefill_key_slots=common.prefill_key_slots,
                                      max_prefill_context_len=common.max_prefill_context_len)


class FlashAttentionImpl(StagedAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ops = load_flash_ops()
        w = self.sliding_window
        self.window_size = (w - 1, 0) if w else (-1, -1)

    def write_kv(self, key, value, kv_cache, slot_mapping):
        triton_ops.write_kv(key, value, kv_cache, slot_mapping)

    def prefill(self, out, query, key, value, kv_cache, metadata):
        out[:] = self._prefill(query, key, value, kv_cache, metadata)

    def _prefill(self, q, k, v, kv_cache, md: FlashAttentionMetadata) -> torch.Tensor:
        kwargs = dict(softmax_scale=self.scale, causal=True, window_size=self.window_size)
        if md.max_prefill_context_len == 0:  # prompts only: the step's keys are all there is
            return self.ops.varlen(q, k, v, md.query_start_loc, md.query_start_loc,
                                   md.max_query_len, md.max_query_len, **kwargs)
        block_size = kv_cache.shape[2]
        if self.ops.takes_block_table(block_size):
            return self.ops.varlen(q, kv_cache[0], kv_cache[1], md.query_start_loc,
                                   md.cu_seqlens_k, md.max_query_len, md.max_seq_len,
                                   block_table=md.block_tables, **kwargs)
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)
        keys, values = flat[0][md.prefill_key_slots], flat[1][md.prefill_key_slots]
        return self.ops.varlen(q, keys, values, md.query_start_loc, md.cu_seqlens_k,
                               md.max_query_len, md.max_seq_len, **kwargs)

    def decode(self, out, q, kv_cache, md: FlashAttentionMetadata) -> None:
        if not self.ops.takes_block_table(kv_cache.shape[2]):
            triton_ops.decode(out, q, kv_cache, md, self.scale, self.sliding_window)
            return
        o = self.ops.with_kvcache(q.unsqueeze(1), kv_cache[0], kv_cache[1],
                                  cache_seqlens=md.seq_lens_tensor, block_table=md.block_tables,
                                  softmax_scale=self.scale, causal=True,
                                  window_size=self.window_size)
        out.copy_(o.squeeze(1))


class FlashAttentionBackend(AttentionBackend):
    name: ClassVar[str] = "FLASH_ATTN"
    supported_device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    supported_platforms: ClassVar[tuple[str, ...]] = ("cuda",)
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float16, torch.bfloat16)
    supports_graph_capture: ClassVar[bool] = True

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if spec.head_size > MAX_HEAD_SIZE or spec.head_size % 8:
            reasons.append(f"head size {spec.head_size} not supported (multiples of 8 up to "
                           f"{MAX_HEAD_SIZE})")
        capability = spec.device_capability
        if capability is None:
            reasons.append("needs an NVIDIA GPU of compute capability 8.0+ (none known)")
        elif capability < MIN_CAPABILITY:
            reasons.append(f"needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+, "
                           f"this GPU has {capability[0]}.{capability[1]}")
        if spec.block_size % BLOCK_SIZE_MULTIPLE:
            reasons.append(f"block size {spec.block_size} is not a multiple of {BLOCK_SIZE_MULTIPLE}")
        try:
            ops = load_flash_ops()
        except ImportError as e:
            return reasons + [f"flash-attn is not importable ({e}); pip install "
                              "'omniinfer-cuda[flash-attn]'"]
        if not ops.takes_block_table(spec.block_size):  # decode then runs the Triton kernel
            reasons += [f"{r} (needed: {ops.module_name}'s paged KV takes only multiples of "
                        f"{ops.paged_block_multiple} as block size)"
                        for r in triton_ops.triton_reasons(spec, (triton_ops.WRITE,
                                                                  triton_ops.DECODE))]
        else:  # the Triton write kernel still fills the cache
            reasons += refusal_reasons(spec, (triton_ops.WRITE,))
        return reasons

    @classmethod
    def get_builder_cls(cls):
        return FlashAttentionMetadataBuilder

    @classmethod
    def get_impl_cls(cls):
        return FlashAttentionImpl
