"""The oracle: a plain, obviously-correct paged attention in float32.

Every other backend is tested against this one, and it is the last fallback on every
platform. It loops over sequences and spells out the softmax; speed is not its job.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from omniinfer.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
)
from omniinfer.attention.ops import causal_mask, gather_kv, write_to_kv_cache


def reference_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor,
                              metadata: AttentionMetadata, scale: float,
                              sliding_window: int | None = None,
                              logits_soft_cap: float | None = None) -> torch.Tensor:
    """query [T, heads, head] (keys/values already in the cache) -> [T, heads, head]."""
    out = torch.empty_like(query)
    num_heads = query.shape[1]
    qsl = metadata.query_start_loc.tolist()
    for i, seq_len in enumerate(metadata.seq_lens):
        q0, q1 = qsl[i], qsl[i + 1]
        k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
        group = num_heads // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)  # [S, heads, head]
        v = v.float().repeat_interleave(group, dim=1)
        q = query[q0:q1].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if logits_soft_cap:
            scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
        mask = causal_mask(seq_len - (q1 - q0), q1 - q0, seq_len, sliding_window, query.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


class ReferenceImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, metadata):
        write_to_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        q = query.view(-1, self.num_heads, self.head_size)
        out = reference_paged_attention(q, kv_cache, metadata, self.scale, self.sliding_window,
                                         self.logits_soft_cap)
        return out.view(-1, self.num_heads * self.head_size)


class ReferenceBackend(AttentionBackend):
    name: ClassVar[str] = "REFERENCE"
    supported_device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "xpu")
    supports_logits_soft_cap: ClassVar[bool] = True
    supports_window_pool: ClassVar[bool] = True

    @classmethod
    def get_impl_cls(cls):
        return ReferenceImpl
