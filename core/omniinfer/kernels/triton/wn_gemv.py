"""The one-to-eight-row decode product of the n-bit weight-only layers (GPTQ / AWQ /
compressed-tensors, in :class:`omniinfer.quantization.int_layouts.PackedIntWeight`'s layout:
int32 words of ``32 // BITS`` codes along K, the outputs contiguous), for quant_gemm.py's
``wn_matmul``.

Each int32 word is loaded once and gives its codes one position at a time (`packed_code`: one
logic instruction and one FMA a code, no conversion), multiplied by the position's inputs;
the pointers advance by a tile a step. One row whose tile lies in one group sums ``x * code``
and ``x`` over the tile and applies the zero point and the scale once an output (``scale *
(sum(x * code) - zero * sum(x))``); more rows, or a group per input (act-order), multiply each
weight ``(code - zero) * scale`` in float32. The sums are float32 and the weights are never
rounded to x's dtype (docs/quantization.md, "Kernels and numerics").
"""

from __future__ import annotations

import triton
import triton.language as tl

INTERPRETED = bool(triton.knobs.runtime.interpret)  # fixed when the kernels below are defined


@triton.jit
def wn_gemv(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, M, N, K, pid_m, stride_xm,
             n, n_ok, k_start, k_end, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
             TILE_IN_ONE_GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             EVEN_K: tl.constexpr):
    """The decode product's float32 sums [BLOCK_M, BLOCK_N] over inputs [k_start, k_end)
    (k_start a multiple of BLOCK_K). Each int32 word of the tile [BLOCK_K / PACK, BLOCK_N] is
    loaded once and gives its PACK codes one position at a time (`packed_code`; a [BLOCK_K,
    BLOCK_N] tile would load every word PACK times), each position with the inputs of its
    rows; the word and input pointers advance by a tile a step instead of being computed
    again from k. One row with one group a tile (the common decode) sums x * code and x over
    the tile, and applies zero and scale once an output: ``scale * (sum(x * code) - zero *
    sum(x))``."""
    PACK: tl.constexpr = 32 // BITS
    MIDPOINT: tl.constexpr = 1 << (BITS - 1)
    KW: tl.constexpr = BLOCK_K // PACK
    TILE_SUMS: tl.constexpr = BLOCK_M == 1 and TILE_IN_ONE_GROUP
    kw = tl.arange(0, KW)
    words_ptr = (qweight_ptr + (k_start // PACK + kw).to(tl.int64)[:, None] * N
                 + n[None, :])  # [KW, BLOCK_N]
    # each word's first input in the tile's first row: position p of row m is at + p + m * stride
    x_first = x_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_xm + k_start + kw * PACK
    acc = tl.zeros([KW, BLOCK_N], tl.float32)  # one row: summed over the words at the end
    if BLOCK_M > 1:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_first = k0 + kw * PACK  # [KW]: each word's first input
        if EVEN_K:  # every split a whole number of tiles: no input masks
            words = tl.load(words_ptr, mask=n_ok[None, :], other=0)
        else:
            words = tl.load(words_ptr, mask=(k_first < k_end)[:, None] & n_ok[None, :], other=0)
        words_high = words >> 16
        if TILE_IN_ONE_GROUP:  # one row of scales (and zeros) for the whole tile
            scale, zero = tile_group(scales_ptr, zeros_ptr, N, k0, n, n_ok, GROUP_SIZE,
                                     HAS_ZEROS, MIDPOINT)
        tile = tl.zeros([KW, BLOCK_N], tl.float32)  # TILE_SUMS: sum(x * code) ..
        x_sum = tl.zeros([KW, 1], tl.float32)  # .. and sum(x)
        for p in tl.static_range(PACK):
            k = k_first + p
            k_ok = k < k_end
            code = packed_code(words, words_high, p, BITS)  # [KW, BLOCK_N]
            if not TILE_IN_ONE_GROUP:
                scale, zero = input_groups(scales_ptr, zeros_ptr, g_idx_ptr, N, k, k_ok, n, n_ok,
                                           GROUP_SIZE, HAS_ZEROS, HAS_G_IDX, MIDPOINT)
            if not TILE_SUMS:
                w = (code - zero) * scale
            for m in tl.static_range(BLOCK_M):
                row = pid_m * BLOCK_M + m
                if EVEN_K:  # (a tensor mask: the interpreter takes no scalar one)
                    x_m = tl.load(x_first + (m * stride_xm + p), mask=kw * 0 + row < M,
                                  other=0.0)
                else:
                    x_m = tl.load(x_first + (m * stride_xm + p), mask=k_ok & (k * 0 + row < M),
                                  other=0.0)
                x_m = x_m.to(tl.float32)[:, None]
                if TILE_SUMS:  # (explicit FMAs: not every build contracts the bfloat16 case)
                    tile = tl.fma(x_m, code, tile)
                    x_sum += x_m
                elif BLOCK_M == 1:
                    acc = tl.fma(x_m, w, acc)
                else:
                    part = tl.sum(x_m * w, 0)  # [BLOCK_N]
                    acc += tl.where(tl.arange(0, BLOCK_M)[:, None] == m, part[None, :], 0.0)
        if TILE_SUMS:
            acc += (tile - zero * x_sum) * scale
        words_ptr += KW * N
        x_first += BLOCK_K
    if BLOCK_M == 1:
        acc = tl.sum(acc, 0)[None, :]
    return acc


@triton.jit
def tile_group(scales_ptr, zeros_ptr, N, k0, n, n_ok, GROUP_SIZE: tl.constexpr,
               HAS_ZEROS: tl.constexpr, NO_ZERO: tl.constexpr):
    """(scale, zero) float32 [1, BLOCK_N] of the group that holds input k0 (GROUP_SIZE 0: one
    group) for outputs n, where a tile lies in one group. NO_ZERO: the zero point where the
    layer has none."""
    if GROUP_SIZE > 0:
        g = k0 // GROUP_SIZE
    else:
        g = 0
    scale = tl.load(scales_ptr + g * N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + g * N + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    else:
        zero = NO_ZERO
    return scale, zero


@triton.jit
def input_groups(scales_ptr, zeros_ptr, g_idx_ptr, N, k, k_ok, n, n_ok, GROUP_SIZE: tl.constexpr,
                 HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, NO_ZERO: tl.constexpr):
    """(scale, zero) float32 [len(k), BLOCK_N] of inputs k (masked by k_ok) for outputs n, each
    input's group read per input: its `g_idx` entry (act-order) or k // GROUP_SIZE. NO_ZERO:
    the zero point where the layer has none."""
    if HAS_G_IDX:
        g = tl.load(g_idx_ptr + k, mask=k_ok, other=0)
    else:
        g = k // GROUP_SIZE
    offsets = g.to(tl.int64)[:, None] * N + n[None, :]
    tile_ok = k_ok[:, None] & n_ok[None, :]
    scale = tl.load(scales_ptr + offsets, mask=tile_ok, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(zeros_ptr + offsets, mask=tile_ok, other=0.0).to(tl.float32)
    else:
        zero = NO_ZERO
    return scale, zero


@triton.jit
def packed_code(words, words_high, P: tl.constexpr, BITS: tl.constexpr):
    """Code P of int32 `words` (bits [P * BITS, P * BITS + BITS)) as an exact float32, in one
    logic instruction and one FMA: masked in place and ORed into the bits of 2**23 (as
    exact_float) it is the float 2**23 + code * 2**s, and ``* 2**-s - 2**(23 - s)`` (exact)
    leaves the code. Codes that do not lie below bit 23 come from `words_high` (``words >>
    16``). (LLVM turns a shift then a mask into a bit-field extract, three instructions on
    sm_90.)"""
    MASK: tl.constexpr = (1 << BITS) - 1
    S: tl.constexpr = code_place(P, BITS)
    if P * BITS + BITS > 23:
        bits = (words_high & (MASK << S)) | 0x4B000000
    else:
        bits = (words & (MASK << S)) | 0x4B000000
    return exact_code(bits, S)


@triton.jit
def exact_code(bits, S: tl.constexpr):
    """The float32 whose bits are 2**23 + c * 2**S (c < 2**(23 - S)), as c, with one exact FMA:
    ``* 2**-S - 2**(23 - S)``."""
    return tl.fma(bits.to(tl.float32, bitcast=True), 1.0 / (1 << S), -8388608.0 / (1 << S))


@triton.jit
def placed_code(low, high, P: tl.constexpr, BITS: tl.constexpr):
    """Code P of an int32 word (bits [P * BITS, P * BITS + BITS)) times 2**code_place(P, BITS),
    an exact float32, in one AND and one add: `low` is the word and `high` the word shifted
    right by 16 (for the codes that do not lie below bit 23), each already ORed with the bits
    of 2**23 (`magic`, exact_float's trick), so the masked bits are the float 2**23 + code *
    2**s. The caller scales the code's input by 2**-s (one multiply an input, shared by the
    outputs a thread holds). `magic` reaches the kernels as a run-time argument: a constant
    would be folded into each code's mask, which ptxas then rematerialises per code."""
    MASK: tl.constexpr = (1 << BITS) - 1
    S: tl.constexpr = code_place(P, BITS)
    if P * BITS + BITS > 23:
        bits = high & ((MASK << S) | 0x4B000000)
    else:
        bits = low & ((MASK << S) | 0x4B000000)
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.constexpr_function
def code_place(P, BITS):
    """The bit where placed_code leaves code P: its own, or 16 less for the codes that do not lie
    below bit 23 (taken from the word's high half)."""
    return P * BITS - 16 if P * BITS + BITS > 23 else P * BITS
