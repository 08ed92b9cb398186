"""TORCH_SDPA: torch's scaled_dot_product_attention over the paged cache.

Prefill sequences run one SDPA call each (with their cached context gathered when a chunk
or a prefix-cache hit left one); all decodes run as one batched SDPA call over their
gathered blocks with a length mask.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from omniinfer.attention.backend import AttentionBackend, StagedAttentionImpl
from omniinfer.attention.ops import causal_mask, gather_kv, write_to_kv_cache


class TorchSDPAImpl(StagedAttentionImpl):
    def write_kv(self, key, value, kv_cache, slot_mapping):
        write_to_kv_cache(key, value, kv_cache, slot_mapping)

    def decode(self, out, query, kv_cache, metadata):
        out[:] = self._decode(query, kv_cache, metadata)

    def prefill(self, out, q, k, v, kv_cache, md) -> None:
        qsl = md.query_start_loc.tolist()
        for i, seq_len in enumerate(md.seq_lens):
            q0, q1 = qsl[i], qsl[i + 1]
            query_len = q1 - q0
            context_len = seq_len - query_len
            qi = q[q0:q1].transpose(0, 1).unsqueeze(0)  # [1, heads, q, head]
            if context_len == 0 and not self.sliding_window:
                ki, vi = k[q0:q1], v[q0:q1]
                mask, is_causal = None, True
            else:
                ki, vi = gather_kv(kv_cache, md.block_tables[i], seq_len)
                mask = causal_mask(context_len, query_len, seq_len, self.sliding_window, q.device)
                is_causal = False
            ki = ki.transpose(0, 1).unsqueeze(0).to(q.dtype)
            vi = vi.transpose(0, 1).unsqueeze(0).to(q.dtype)
            o = self._attend(qi, ki, vi, mask, is_causal)
            out[q0:q1] = o[0].transpose(0, 1)

    def _decode(self, q, kv_cache, md) -> torch.Tensor:
        num_seqs = q.shape[0]
        block_size = kv_cache.shape[2]
        max_blocks = (md.max_seq_len + block_size - 1) // block_size
        tables = md.block_tables[:, :max_blocks].reshape(-1).long()
        # index_select of whole blocks (7x faster than advanced indexing on the CPU), then
        # [seqs * blocks, block_size, kv_heads, head] -> [seqs, kv_heads, max_len, head]
        shape = (num_seqs, max_blocks * block_size, *kv_cache.shape[3:])
        k = kv_cache[0].index_select(0, tables).view(shape).transpose(1, 2).to(q.dtype)
        v = kv_cache[1].index_select(0, tables).view(shape).transpose(1, 2).to(q.dtype)
        positions = torch.arange(k.shape[2], device=q.device)
        seq_lens = md.seq_lens_tensor.to(q.device).long()[:, None]
        mask = positions[None, :] < seq_lens
        if self.sliding_window:
            mask &= positions[None, :] >= seq_lens - self.sliding_window
        o = self._attend(q.unsqueeze(2), k, v, mask[:, None, None, :], False)
        return o.view(num_seqs, self.num_heads, self.head_size)


    def _attend(self, q, k, v, mask, is_causal: bool) -> torch.Tensor:
        """q [B, heads, Q, head], k/v [B, kv_heads, S, head]; `mask` True where a key is seen."""
        if not self.logits_soft_cap:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                                  scale=self.scale, enable_gqa=True)
        # SDPA has no soft cap: the same softmax spelled out, in float32
        group = q.shape[1] // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = q.float() @ k.transpose(-1, -2) * self.scale
        scores = torch.tanh(scores / self.logits_soft_cap) * self.logits_soft_cap
        if is_causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)


class TorchSDPABackend(AttentionBackend):
    name: ClassVar[str] = "TORCH_SDPA"
    supported_device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "xpu")
    supports_logits_soft_cap: ClassVar[bool] = True
    supports_window_pool: ClassVar[bool] = True


    @classmethod
    def get_impl_cls(cls):
        return TorchSDPAImpl
