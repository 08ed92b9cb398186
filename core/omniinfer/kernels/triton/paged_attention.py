"""Paged attention in Triton: one kernel for prefill chunks over a cached prefix and for decodes.

Every key, the step's own included, is read from the paged cache (the backend writes the step's
keys first), so a prefill chunk attends to its cached context and causally within itself with
one code path, and a prefix-cache hit or a chunked prefill is just a longer context.

A program handles one sequence, one kv head and a tile of ``BLOCK_Q`` query tokens; its rows
are (token, query head of that kv head) pairs, so grouped-query attention reads each key once
for the whole group. Keys are visited ``TILE_N`` at a time, each looked up through the block
table (any block size; a tile may span several blocks), with an online softmax in float32.
Head sizes that are not a power of two (80, 96...) are padded and masked.

Written for NVIDIA, AMD and Intel Triton back ends and the CPU interpreter: plain loads with
masks, ``tl.dot`` on tiles of at least 16, no vendor intrinsics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED = bool(triton.knobs.runtime.interpret)  # fixed when the kernel below is defined
# Triton's interpreter multiplies bfloat16 operands of tl.dot as their raw uint16 storage (triton
# 3.9), so interpreted kernels do their dots in float32.
MIN_DOT = 16  # tl.dot needs every dimension >= 16 on GPUs


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, IS_DECODE: tl.constexpr, DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if IS_DECODE:  # one query per sequence; its token row is the sequence index
        q_start = seq
        query_len = 1
    else:
        q_start = tl.load(query_start_loc_ptr + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= query_len:
        return
    context_len = seq_len - query_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    rows = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD  # query token within the sequence
    head_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_ok = (token < query_len) & (head_in_group < GROUP)
    q_pos = context_len + token  # absolute position of each row's token
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)

    # keys this tile can see: [lo, hi)
    hi = context_len + tl.minimum(query_len, (q_tile + 1) * BLOCK_Q)
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(context_len + q_tile * BLOCK_Q - SLIDING_WINDOW + 1, 0)
        lo = (lo // TILE_N) * TILE_N
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, TILE_N):
        n = start + tl.arange(0, TILE_N)
        n_ok = n < hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        offset = n % BLOCK_SIZE
        k = tl.load(key_cache_ptr + block[None, :] * stride_kb + offset[None, :] * stride_ks
                    + kv_head * stride_kh + d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_PAD, TILE_N]
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee") * scale  # [BLOCK_M, TILE_N], float32
        allowed = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        if SLIDING_WINDOW > 0:
            allowed = allowed & (n[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(value_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
                    + kv_head * stride_vh + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE_N, HEAD_PAD]
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _check(out, query, key_cache, value_cache, block_tables) -> None:
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of kv heads "
                         f"({key_cache.shape[2]})")
    for name, t in (("out", out), ("query", query), ("key_cache", key_cache),
                    ("value_cache", value_cache), ("block_tables", block_tables)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def _tiles(head_size: int, group: int, block_m: int) -> tuple[int, int, int, int]:
    """(HEAD_PAD, GROUP_PAD, BLOCK_Q, TILE_N) for a tile of about `block_m` rows."""
    head_pad = max(MIN_DOT, triton.next_power_of_2(head_size))
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, block_m // group_pad)
    tile_n = 32 if head_pad <= 128 else 16
    return head_pad, group_pad, block_q, tile_n


def _launch(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            grid_q: int, block_q: int, head_pad: int, group_pad: int, tile_n: int, scale: float,
            sliding_window: int | None, is_decode: bool, num_warps: int = 4) -> None:
    num_seqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    _paged_attention_kernel[(num_seqs, grid_q, num_kv_heads)](
        out, query, key_cache, value_cache, block_tables, seq_lens,
        seq_lens if query_start_loc is None else query_start_loc,
        scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        HEAD_SIZE=query.shape[2], HEAD_PAD=head_pad,
        GROUP=query.shape[1] // num_kv_heads, GROUP_PAD=group_pad,
        BLOCK_Q=block_q, TILE_N=tile_n, BLOCK_SIZE=key_cache.shape[1],
        SLIDING_WINDOW=sliding_window or 0, IS_DECODE=is_decode, DOT_F32=INTERPRETED,
        num_warps=num_warps,
    )


def paged_decode_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float,
                           sliding_window: int | None = None) -> None:
    """One new token per sequence against its cached keys (its own key already written).

    out/query [num_seqs, heads, head]; caches [blocks, block_size, kv_heads, head];
    block_tables [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32 (keys incl. the new one).
    Reads nothing from the host: safe to capture in a device graph.
    """
    if query.shape[0] == 0:
        return
    _check(out, query, key_cache, value_cache, block_tables)
    group = query.shape[1] // key_cache.shape[2]
    head_pad, group_pad, _, tile_n = _tiles(query.shape[2], group, MIN_DOT)
    block_q = max(1, MIN_DOT // group_pad)  # rows beyond the one query are masked
    _launch(out, query, key_cache, value_cache, block_tables, seq_lens, None, 1, block_q,
            head_pad, group_pad, tile_n, scale, sliding_window, is_decode=True)


def paged_prefill_attention(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                            max_query_len: int, scale: float,
                            sliding_window: int | None = None) -> None:
    """Query chunks (varlen, by `query_start_loc`) against each sequence's cached context and,
    causally, themselves. Keys and values of the chunk must already be in the cache.

    out/query [num_tokens, heads, head]; query_start_loc [num_seqs + 1] int32 (from 0);
    seq_lens [num_seqs] int32: context + chunk; `max_query_len` sizes the grid.
    """
    if query.shape[0] == 0:
        return
    _check(out, query, key_cache, value_cache, block_tables)
    group = query.shape[1] // key_cache.shape[2]
    # float32 tiles take twice the registers: the half-precision tile with 4 warps spills on
    # NVIDIA (ptxas: 14 KB at head 128, 1.5 KB at 256); half the rows on 8 warps does not
    # (python -m omniinfer.testing.kernels_aot). The interpreter, whose cost is per program,
    # keeps the bigger tile.
    wide = query.element_size() == 4 and not INTERPRETED
    block_m = (64 if query.shape[2] <= 128 else 32) // (2 if wide else 1)
    head_pad, group_pad, block_q, tile_n = _tiles(query.shape[2], group, block_m)
    block_q = min(block_q, max(1, triton.next_power_of_2(max_query_len)))
    block_q = max(block_q, max(1, MIN_DOT // group_pad))
    grid_q = triton.cdiv(max_query_len, block_q)
    _launch(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, grid_q,
            block_q, head_pad, group_pad, tile_n, scale, sliding_window, is_decode=False,
            num_warps=8 if wide else 4)
