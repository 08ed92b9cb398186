"""Pure-torch stand-ins for vendor attention libraries, written from their documented contracts.

Each fake implements the documented signature and semantics of the functions omniinfer calls
and asserts the argument contract (dtypes, shapes, the paged block-size rule), so a contract
test that runs a backend's forward path against a fake checks both the numbers and the call.

* flash-attn 2.x (``flash_attn_interface.py``): ``flash_attn_varlen_func``,
  ``flash_attn_with_kvcache``; causal masks aligned to the bottom right; ``window_size=(left,
  right)`` keeps keys in [i + sk - sq - left, i + sk - sq + right]; fp16/bf16 only; a paged
  cache's block size must be a multiple of 256 (upstream) or 16 (vLLM's fork).
* xformers (``xformers.ops.fmha``): ``memory_efficient_attention_forward`` on [B, M, H, K] or
  [B, M, G, H, K] inputs and the block-diagonal biases of ``attn_bias``.
* intel-extension-for-pytorch (``ipex.llm.modules.PagedAttention``): ``reshape_and_cache``,
  ``single_query_cached_kv_attention``, ``flash_attn_varlen_func`` over caches laid out
  [num_blocks, num_heads, block_size, head_size].
"""

from __future__ import annotations

import types

import torch


def _attend(q, k, v, scale, allowed) -> torch.Tensor:
    """q [sq, H, D], k/v [sk, H_kv, D], allowed [sq, sk] -> [sq, H, D] (rows seeing nothing: 0)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def _bottom_right(sq: int, sk: int, causal: bool, window_size) -> torch.Tensor:
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    left, right = window_size
    right = 0 if causal else right
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    return allowed


# ---- flash-attn ------------------------------------------------------------------------------
def make_flash_attn(name: str = "flash_attn", paged_block_multiple: int = 256) -> types.ModuleType:
    module = types.ModuleType(name)
    module.calls = []

    def check_common(q, k_cache, block_table):
        assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only supports fp16 and bf16"
        assert q.stride(-1) == 1 and k_cache.stride(-1) == 1, "last dimension must be contiguous"
        if block_table is not None:
            assert block_table.dtype == torch.int32, "block_table must have dtype torch.int32"
            assert k_cache.shape[1] % paged_block_multiple == 0, (
                f"Paged KV cache block size must be divisible by {paged_block_multiple}")

    def paged_keys(cache, table, n):
        block_size = cache.shape[1]
        blocks = table[: -(-n // block_size)].long()
        return cache[blocks].flatten(0, 1)[:n]

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        check_common(q, k, block_table)
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
        module.calls.append(("varlen", block_table is not None))
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        out = torch.empty_like(q)
        for b in range(len(cq) - 1):
            sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            assert sq <= max_seqlen_q and sk <= max_seqlen_k, "max_seqlen is a bound"
            if block_table is None:
                kb, vb = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
            else:
                kb, vb = paged_keys(k, block_table[b], sk), paged_keys(v, block_table[b], sk)
            out[cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], kb, vb, scale,
                                          _bottom_right(sq, sk, causal, window_size))
        return out

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                                rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                cache_leftpad=None, block_table=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):
        check_common(q, k_cache, block_table)
        assert k is None and v is None, "omniinfer writes the cache itself"
        assert cache_seqlens.dtype == torch.int32
        module.calls.append(("kvcache", block_table is not None))
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out = torch.empty_like(q)
        for b, sk in enumerate(cache_seqlens.tolist()):
            if block_table is None:
                kb, vb = k_cache[b, :sk], v_cache[b, :sk]
            else:
                kb, vb = paged_keys(k_cache, block_table[b], sk), paged_keys(v_cache, block_table[b], sk)
            out[b] = _attend(q[b], kb, vb, scale, _bottom_right(q.shape[1], sk, causal, window_size))
        return out

    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


# ---- xformers --------------------------------------------------------------------------------
def make_xformers() -> dict[str, types.ModuleType]:
    """The modules `xformers`, `xformers.ops`, `xformers.ops.fmha`, `xformers.ops.fmha.attn_bias`."""
    calls = []

    class BlockDiagonalMask:
        bottom_right = False
        causal = False

        def __init__(self, q_seqlen, kv_seqlen, window=None):
            self.q_seqlen, self.kv_seqlen, self.window = list(q_seqlen), list(kv_seqlen), window

        @classmethod
        def from_seqlens(cls, q_seqlen, kv_seqlen=None):
            return cls(q_seqlen, q_seqlen if kv_seqlen is None else kv_seqlen)

        def make_local_attention(self, window_size):
            return BlockDiagonalCausalLocalAttentionMask(self.q_seqlen, self.kv_seqlen, window_size)

        def make_local_attention_from_bottomright(self, window_size):
            return BlockDiagonalCausalLocalAttentionFromBottomRightMask(
                self.q_seqlen, self.kv_seqlen, window_size)

        def block(self, sq: int, sk: int) -> torch.Tensor:
            """Like xformers' _materialize_causal_mask: tril(shift), triu(shift - window + 1)."""
            mask = torch.ones(sq, sk, dtype=torch.bool)
            if not self.causal:
                return mask
            shift = sk - sq if self.bottom_right else 0
            mask = torch.tril(mask, diagonal=shift)
            if self.window is not None:
                mask = torch.triu(mask, diagonal=shift - self.window + 1)
            return mask

        def materialize_bool(self) -> torch.Tensor:
            out = torch.zeros(sum(self.q_seqlen), sum(self.kv_seqlen), dtype=torch.bool)
            q0 = k0 = 0
            for sq, sk in zip(self.q_seqlen, self.kv_seqlen):
                out[q0:q0 + sq, k0:k0 + sk] = self.block(sq, sk)
                q0, k0 = q0 + sq, k0 + sk
            return out

    class BlockDiagonalCausalMask(BlockDiagonalMask):
        causal = True

    class BlockDiagonalCausalFromBottomRightMask(BlockDiagonalMask):
        causal, bottom_right = True, True

        def __init__(self, q_seqlen, kv_seqlen, window=None):
            super().__init__(q_seqlen, kv_seqlen, window)
            for i, (sq, sk) in enumerate(zip(self.q_seqlen, self.kv_seqlen)):
                if sk < sq:
                    raise ValueError(f"Block #{i} has num_keys={sk} and num_queries={sq}. "
                                     "Expected `num_keys >= num_queries`")

    class BlockDiagonalCausalLocalAttentionMask(BlockDiagonalCausalMask):
        pass

    class BlockDiagonalCausalLocalAttentionFromBottomRightMask(BlockDiagonalCausalFromBottomRightMask):
        pass

    def memory_efficient_attention_forward(query, key, value, attn_bias=None, p=0.0, scale=None,
                                           *, op=None, output_dtype=None):
        assert p == 0.0 and query.dim() in (4, 5) and key.shape == value.shape
        assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
        assert isinstance(attn_bias, BlockDiagonalMask) and query.shape[0] == 1
        calls.append(type(attn_bias).__name__)
        # [1, M, G, H, K] -> [M, G * H, K]: each (group, head) pair is one attention head
        q = query.reshape(query.shape[1], -1, query.shape[-1])
        k = key.reshape(key.shape[1], -1, key.shape[-1])
        v = value.reshape(value.shape[1], -1, value.shape[-1])
        assert sum(attn_bias.q_seqlen) == q.shape[0] and sum(attn_bias.kv_seqlen) == k.shape[0]
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        allowed = attn_bias.materialize_bool()
        out = _attend(q, k, v, scale, allowed)
        return out.reshape(query.shape)

    bias = types.ModuleType("xformers.ops.fmha.attn_bias")
    for cls in (BlockDiagonalMask, BlockDiagonalCausalMask, BlockDiagonalCausalFromBottomRightMask,
                BlockDiagonalCausalLocalAttentionMask,
                BlockDiagonalCausalLocalAttentionFromBottomRightMask):
        setattr(bias, cls.__name__, cls)
    fmha = types.ModuleType("xformers.ops.fmha")
    fmha.attn_bias = bias
    ops = types.ModuleType("xformers.ops")
    ops.fmha = fmha
    ops.memory_efficient_attention_forward = memory_efficient_attention_forward
    ops.calls = calls
    root = types.ModuleType("xformers")
    root.ops = ops
    return {"xformers": root, "xformers.ops": ops, "xformers.ops.fmha": fmha,
            "xformers.ops.fmha.attn_bias": bias}


# ---- intel-extension-for-pytorch -------------------------------------------------------------
def make_ipex(with_scales: bool = True) -> types.ModuleType:
    """`intel_extension_for_pytorch` with llm.modules.PagedAttention: the 2.x signatures with
    fp8 scales (k_scale, v_scale before alibi_slopes), or the older ones without."""
    calls = []

    def keys_of(cache, table, n):  # cache [blocks, heads, block_size, head]
        blocks = table[: -(-n // cache.shape[2])].long()
        return cache[blocks].transpose(1, 2).flatten(0, 1)[:n]

    def write(key, value, key_cache, value_cache, slot_mapping):
        calls.append(("reshape_and_cache", slot_mapping.dtype))
        for t, slot in enumerate(slot_mapping.tolist()):
            block, offset = divmod(slot, key_cache.shape[2])
            key_cache[block, :, offset] = key[t]
            value_cache[block, :, offset] = value[t]

    def decode(output, query, key_cache, value_cache, head_mapping, scale, block_tables,
               context_lens, block_size, max_context_len, alibi_slopes):
        assert head_mapping.dtype == torch.int32 and block_size == key_cache.shape[2]
        assert int(context_lens.max()) <= max_context_len and alibi_slopes is None
        calls.append(("single_query_cached_kv_attention",))
        for b, n in enumerate(context_lens.tolist()):
            k = keys_of(key_cache, block_tables[b], n)[:, head_mapping.long()]
            v = keys_of(value_cache, block_tables[b], n)[:, head_mapping.long()]
            output[b] = _attend(query[b:b + 1], k, v, scale, torch.ones(1, n, dtype=torch.bool))[0]

    def prefill(output, query, key_cache, value_cache, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q,
                max_seqlen_kv, scale, is_cusal, block_tables, alibi_slopes):
        assert is_cusal, "False is not supported yet" and alibi_slopes is None
        calls.append(("flash_attn_varlen_func",))
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_kv.tolist()
        for b in range(len(cq) - 1):
            sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            assert sq <= max_seqlen_q and sk <= max_seqlen_kv
            k, v = keys_of(key_cache, block_tables[b], sk), keys_of(value_cache, block_tables[b], sk)
            output[cq[b]:cq[b + 1]] = _attend(query[cq[b]:cq[b + 1]], k, v, scale,
                                              _bottom_right(sq, sk, True, (-1, -1)))

    if with_scales:
        class PagedAttention:
            @classmethod
            def reshape_and_cache(cls, key, value, key_cache, value_cache, slot_mapping, k_scale,
                                  v_scale):
                assert k_scale == v_scale == 1.0
                write(key, value, key_cache, value_cache, slot_mapping)

            @classmethod
            def single_query_cached_kv_attention(cls, output, query, key_cache, value_cache,
                                                 head_mapping, scale, block_tables, context_lens,
                                                 block_size, max_context_len, k_scale, v_scale,
                                                 alibi_slopes):
                decode(output, query, key_cache, value_cache, head_mapping, scale, block_tables,
                       context_lens, block_size, max_context_len, alibi_slopes)

            @classmethod
            def flash_attn_varlen_func(cls, output, query, key_cache, value_cache, cu_seqlens_q,
                                       cu_seqlens_kv, max_seqlen_q, max_seqlen_kv, scale, is_cusal,
                                       block_tables, k_scale, v_scale, alibi_slopes):
                prefill(output, query, key_cache, value_cache, cu_seqlens_q, cu_seqlens_kv,
                        max_seqlen_q, max_seqlen_kv, scale, is_cusal, block_tables, alibi_slopes)
    else:
        class PagedAttention:
            reshape_and_cache = staticmethod(write)
            single_query_cached_kv_attention = staticmethod(decode)
            flash_attn_varlen_func = staticmethod(prefill)

    module = types.ModuleType("intel_extension_for_pytorch")
    module.llm = types.SimpleNamespace(modules=types.SimpleNamespace(PagedAttention=PagedAttention))
    module.calls = calls
    return module
