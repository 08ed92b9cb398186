"""The attention layer the models use: q/k/v in, the selected backend's impl underneath."""

from __future__ import annotations

import torch
from torch import nn

from omniinfer.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, backend: type[AttentionBackend], num_heads: int, head_size: int,
                 scale: float, num_kv_heads: int, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None):
        """`sliding_window`: this layer's (keys a query sees, itself included; None: all);
        `logits_soft_cap`: scores become cap * tanh(scores / cap) before the softmax (Gemma 2).
        The impl gets `logits_soft_cap` only when set (a backend that cannot apply it refuses
        at selection: `AttentionBackend.supports_logits_soft_cap`)."""
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.sliding_window = sliding_window
        extra = {"logits_soft_cap": float(logits_soft_cap)} if logits_soft_cap else {}
        self.impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, sliding_window,
                                           **extra)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        if self.sliding_window:  # its blocks come from the window pool, where there is one
            attn_metadata = attn_metadata.for_window
        return self.impl.forward(query, key, value, kv_cache, attn_metadata)
