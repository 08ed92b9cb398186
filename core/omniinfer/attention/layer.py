"""The attention layer the models use: q/k/v in, the selected backend's impl underneath."""

from __future__ import annotations

import torch
from torch import nn

from omniinfer.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, backend: type[AttentionBackend], num_heads: int, head_size: int,
                 scale: float, num_kv_heads: int, sliding_window: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, sliding_window)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.impl.forward(query, key, value, kv_cache, attn_metadata)
