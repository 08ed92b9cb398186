"""XFORMERS: xformers' memory-efficient attention for prefill, the core Triton kernel for decode.

The library's contract (``xformers.ops.memory_efficient_attention_forward(query, key, value,
attn_bias=None, p=0.0, scale=None)``): inputs [B, M, H, K], or [B, M, G, H, K] for grouped-query
attention with keys expanded over H; with a block-diagonal bias B is 1 and the sequences are
concatenated along M. Biases from ``xformers.ops.fmha.attn_bias``:

* ``BlockDiagonalCausalMask.from_seqlens(q_seqlen)``: prompts without cached context;
* ``BlockDiagonalCausalFromBottomRightMask.from_seqlens(q_seqlen, kv_seqlen)``: chunks after a
  cached context (the last query sees the last key);
* ``.make_local_attention(window)`` / ``.make_local_attention_from_bottomright(window)`` on a
  ``BlockDiagonalMask``: the same with a sliding window (keys less than `window` back).

Cached context is gathered through the common metadata's prefill key slots. Decodes use the
core Triton paged kernel, which reads only device tensors (CUDA graphs can replay it).
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

MIN_CAPABILITY = (7, 5)  # xformers' kernels need 6.0+, the Triton decode kernel 7.5+
MAX_HEAD_SIZE = 256


def load_xformers():
    """(memory_efficient_attention_forward, attn_bias module); raises ImportError."""
    ops = importlib.import_module("xformers.ops")
    attn_bias = importlib.import_module("xformers.ops.fmha.attn_bias")
    return ops.memory_efficient_attention_forward, attn_bias


def prefill_bias(attn_bias, query_lens: list[int], seq_lens: list[int], window: int | None):
    """The block-diagonal causal bias for a batch of prefill chunks."""
    has_context = query_lens != seq_lens
    if window:
        mask = attn_bias.BlockDiagonalMask.from_seqlens(query_lens, seq_lens)
        return (mask.make_local_attention_from_bottomright(window) if has_context
                else mask.make_local_attention(window))
    if has_context:
        return attn_bias.BlockDiagonalCausalFromBottomRightMask.from_seqlens(query_lens, seq_lens)
    return attn_bias.BlockDiagonalCausalMask.from_seqlens(query_lens)


class XFormersImpl(StagedAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.attention, self.attn_bias = load_xformers()

    def write_kv(self, key, value, kv_cache, slot_mapping):
        triton_ops.write_kv(key, value, kv_cache, slot_mapping)

    def prefill(self, out, query, key, value, kv_cache, metadata):
        out[:] = self._prefill(query, key, value, kv_cache, metadata)

    def decode(self, out, query, kv_cache, metadata):
        triton_ops.decode(out, query, kv_cache, metadata, self.scale, self.sliding_window)

    def _prefill(self, q, k, v, kv_cache, md: PrefillKeySlotsMetadata) -> torch.Tensor:
        if md.max_prefill_context_len:
            flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)
            k, v = flat[0][md.prefill_key_slots], flat[1][md.prefill_key_slots]
        bias = prefill_bias(self.attn_bias, md.query_lens, md.seq_lens, self.sliding_window)
        group = self.num_heads // self.num_kv_heads
        shape_q = (1, q.shape[0], self.num_kv_heads, group, self.head_size)
        shape_k = (1, k.shape[0], self.num_kv_heads, group, self.head_size)
        o = self.attention(q.reshape(shape_q),
                           k.reshape(1, k.shape[0], self.num_kv_heads, 1, self.head_size).expand(shape_k),
                           v.reshape(1, v.shape[0], self.num_kv_heads, 1, self.head_size).expand(shape_k),
                           attn_bias=bias, p=0.0, scale=self.scale)
        return o.reshape(q.shape)


class XFormersBackend(AttentionBackend):
    name: ClassVar[str] = "XFORMERS"
    supported_device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    supported_platforms: ClassVar[tuple[str, ...]] = ("cuda",)
    supports_graph_capture: ClassVar[bool] = True

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        capability = spec.device_capability
        if capability is not None and capability < MIN_CAPABILITY:
            reasons.append(f"needs compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+, "
                           f"this GPU has {capability[0]}.{capability[1]}")
        if spec.head_size > MAX_HEAD_SIZE or spec.head_size % 8:
            reasons.append(f"head size {spec.head_size} not supported (multiples of 8 up to "
                           f"{MAX_HEAD_SIZE})")
        try:
            load_xformers()
        except ImportError as e:
            reasons.append(f"xformers is not importable ({type(e).__name__}: {e}); pip install "
                           "'omniinfer-cuda[xformers]'")
        reasons += [f"{r} (needed for decode)"
                    for r in triton_ops.triton_reasons(spec, (triton_ops.WRITE, triton_ops.DECODE))
                    if not r.startswith("head size")]
        return reasons

    @classmethod
    def get_builder_cls(cls):
        return PrefillKeySlotsMetadataBuilder

    @classmethod
    def get_impl_cls(cls):
        return XFormersImpl
