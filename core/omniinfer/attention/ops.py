"""Pure-torch attention building blocks shared by the portable backends."""

from __future__ import annotations

import torch


def write_to_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values ([T, kv_heads, head]) at their slots in a
    [2, blocks, block_size, kv_heads, head] cache."""
    if slot_mapping.numel() == 0:
        return
    num_kv_heads, head_size = kv_cache.shape[-2], kv_cache.shape[-1]
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    flat[0].index_copy_(0, slot_mapping, key.view(-1, num_kv_heads, head_size).to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.view(-1, num_kv_heads, head_size).to(kv_cache.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one sequence's first `seq_len` positions: each [seq_len, kv_heads, head]."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:seq_len]
    v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:seq_len]
    return k, v


def causal_mask(context_len: int, query_len: int, seq_len: int, sliding_window: int | None,
                device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool, True where query i (position context_len + i) may see key j."""
    q_pos = torch.arange(context_len, context_len + query_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window:
        mask &= k_pos > q_pos - sliding_window
    return mask
