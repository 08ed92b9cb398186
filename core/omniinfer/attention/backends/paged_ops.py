"""Backends over a library of paged-attention ops with vLLM's original calling convention.

Intel's extension (``ipex.llm.modules.PagedAttention``) follows it on CPUs and Intel GPUs; the
CPU and XPU plugins each bind it in a few lines (plugins may not share code, and this part is
vendor-neutral: it names the convention, never imports a library). The ops object provides:

* ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping[, k_scale, v_scale])``
  key/value [T, kv_heads, head]; slot_mapping [T];
* ``single_query_cached_kv_attention(out, query, key_cache, value_cache, head_mapping, scale,
  block_tables, context_lens, block_size, max_context_len[, k_scale, v_scale], alibi_slopes)``
  out/query [seqs, heads, head]; head_mapping [heads] int32 (query head -> kv head);
  context_lens [seqs] int32 (keys per sequence, the new one included);
* ``flash_attn_varlen_func(out, query, key_cache, value_cache, cu_seqlens_q, cu_seqlens_kv,
  max_seqlen_q, max_seqlen_kv, scale, is_causal, block_tables[, k_scale, v_scale],
  alibi_slopes)`` causal within each sequence, aligned to its last key (paged prefix);

with caches laid out [num_blocks, num_kv_heads, block_size, head] (IPEX's documented layout),
so this backend's KV cache is [2, num_blocks, num_kv_heads, block_size, head]. Newer releases
add ``k_scale, v_scale`` (fp8 caches) before ``alibi_slopes``: 1.0 is passed when present.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from typing import ClassVar

import torch
import torch.nn.functional as F

from omniinfer.attention.backend import AttentionBackend, AttentionImpl, AttentionSpec


def _takes_scales(fn) -> bool:
    try:
        return "k_scale" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a C++ binding without a signature: the older form
        return False


class PagedOpsImpl(AttentionImpl):
    """Subclasses implement :meth:`load_ops`; `slot_mapping_dtype` is what their write wants."""

    slot_mapping_dtype: ClassVar[torch.dtype] = torch.int64

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ops = self.load_ops()
        self.scales = {name: [1.0, 1.0] if _takes_scales(getattr(self.ops, name)) else []
                       for name in ("reshape_and_cache", "single_query_cached_kv_attention",
                                    "flash_attn_varlen_func")}
        self._head_mapping: torch.Tensor | None = None

    def load_ops(self):
        """The object holding the three ops (e.g. ``ipex.llm.modules.PagedAttention``)."""
        raise NotImplementedError

    def head_mapping(self, device: torch.device) -> torch.Tensor:
        if self._head_mapping is None or self._head_mapping.device != device:
            group = self.num_heads // self.num_kv_heads
            self._head_mapping = torch.arange(self.num_kv_heads, dtype=torch.int32,
                                              device=device).repeat_interleave(group)
        return self._head_mapping

    def forward(self, query, key, value, kv_cache, metadata):
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size).contiguous()
        k = key.view(num_tokens, self.num_kv_heads, self.head_size).contiguous()
        v = value.view(num_tokens, self.num_kv_heads, self.head_size).contiguous()
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        self.ops.reshape_and_cache(k, v, key_cache, value_cache,
                                   metadata.slot_mapping.to(self.slot_mapping_dtype),
                                   *self.scales["reshape_and_cache"])
        out = torch.empty_like(q)
        n = metadata.num_prefill_tokens
        if (p := metadata.prefill_metadata) is not None:
            cu_k = F.pad(p.seq_lens_tensor.cumsum(0), (1, 0)).to(torch.int32)
            self.ops.flash_attn_varlen_func(
                out[:n], q[:n], key_cache, value_cache, p.query_start_loc.to(torch.int32), cu_k,
                p.max_query_len, p.max_seq_len, self.scale, True, p.block_tables,
                *self.scales["flash_attn_varlen_func"], None)
        if (d := metadata.decode_metadata) is not None:
            self.ops.single_query_cached_kv_attention(
                out[n:], q[n:], key_cache, value_cache, self.head_mapping(q.device), self.scale,
                d.block_tables, d.seq_lens_tensor, key_cache.shape[2], d.max_seq_len,
                *self.scales["single_query_cached_kv_attention"], None)
        return out.view(num_tokens, self.num_heads * self.head_size)


def library_reason(module: str, install_hint: str) -> str | None:
    """Why `module` cannot be used (not installed, or failing to import), or None."""
    if importlib.util.find_spec(module) is None:  # cheap: asked on every engine start
        return f"{module} is not installed ({install_hint})"
    try:
        importlib.import_module(module)
    except Exception as e:  # built for another torch, most often
        return f"{module} is not importable ({type(e).__name__}: {e})"
    return None


class PagedOpsBackend(AttentionBackend):
    """Descriptor base: the [2, blocks, kv_heads, block_size, head] layout, no sliding window,
    refused with the reason when its `library` does not import."""

    supports_sliding_window: ClassVar[bool] = False
    library: ClassVar[str] = ""  # the module providing the ops
    install_hint: ClassVar[str] = ""  # e.g. "pip install 'omniinfer-cpu[ipex]'"

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        reason = library_reason(cls.library, cls.install_hint) if cls.library else None
        return [reason] if reason else []

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)

