"""The one-row decode product of the classic GGUF block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and
IQ4_NL in Triton, on the file's own blocks (gguf_gemm.py holds the other types' and more rows').

Every block is an even number of bytes, so a block is read as int16 halfwords: its float16
d (and minimum), its fifth bits, and its codes, each halfword of codes holding four nibbles
(weights 2h, 2h + 1 in its low nibbles, 2h + 16, 2h + 17 in its high: the order of the
block's bytes) or two int8 codes. Each code is turned into an exact float32 with one logic
instruction and one FMA (wn_gemv.packed_code's trick: masked in place, ORed into the bits
of 2**23), multiplied by its input and summed per output and halfword, with the inputs' sum
beside it; d and the minimum are applied once a block:

    Q4_0: d * (sum(x * q) - 8 * sum(x))     Q4_1: d * sum(x * q) + m * sum(x)
    Q5_0: d * (sum(x * q) - 16 * sum(x))    Q5_1: d * sum(x * q) + m * sum(x)
    Q8_0: d * (sum(x * u) - 128 * sum(x)), u = the int8 code + 128 (its top bit flipped)
    IQ4_NL: d * sum(x * IQ4_VALUES[q]), the table's value computed from q (`iq4_value`)

The block pointers advance by a block a step. The float32 sums differ from the reference's
products of x and the dequantised weight (d * q, rounded to x's dtype) by that rounding and the
order of the sums, as the other GEMVs (docs/quantization.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from omniinfer.kernels.triton.wn_gemv import exact_code

INTERPRETED = bool(triton.knobs.runtime.interpret)  # fixed when the kernels below are defined

CLASSIC_GEMV_TYPES = (2, 3, 6, 7, 8, 20)  # GGML codes: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL

# IQ4_VALUES[q] = round(p(q)) for p = -127 + c1 q + c2 q^2 + c3 q^3 + c4 q^4, the degree-4
# polynomial nearest the table in the max norm with an integer constant (a linear program):
# |p(q) - IQ4_VALUES[q]| <= 0.4397 at every code, the float32 Horner steps' own error ~1e-5, so
# the rounding never crosses a half. c1..c4, float32 values (a test holds iq4_value to the table
# at every code, and p to that bound).
IQ4_POLY = (24.500598907470703, -1.4385637044906616, 0.03627324849367142, 0.0014480184763669968)
_C1, _C2, _C3, _C4 = (tl.constexpr(c) for c in IQ4_POLY)


@triton.jit
def iq4_value(q):
    """IQ4_VALUES[q] for float32 codes q (0..15, exact), as exact float32, in register arithmetic
    (a 16-entry table would be a load a weight): IQ4_POLY's polynomial in four explicit FMAs
    (the interpreter and every GPU round each once), the last adding -127 + 1.5 * 2**23 so that
    its one rounding is to an integer (floats in [2**23, 2**24) are 1 apart), and one exact
    subtraction of 1.5 * 2**23."""
    h = tl.fma(q, _C4, _C3)
    h = tl.fma(h, q, _C2)
    h = tl.fma(h, q, _C1)
    return tl.fma(h, q, 12582785.0) - 12582912.0


@triton.jit
def _code(qs, qh_h, C: tl.constexpr, TYPE: tl.constexpr):
    """Code C of each halfword of codes `qs` [BLOCK_N, NQ] (int32; halfword h's weight 2h + C
    for 4- and 5-bit types, C in 0, 1, 16, 17; Q8_0: weight 2h + C, C in 0, 1), as an exact
    float32 (Q8_0: the code + 128; IQ4_NL: the IQ4_VALUES entry it indexes). `qh_h`: Q5's fifth
    bits shifted right by 2h, so that the bit of weight 2h + C is its bit C."""
    if TYPE == 8:
        S: tl.constexpr = 8 * C  # byte C of the halfword, its top bit flipped
        bits = ((qs ^ (0x80 << S)) & (0xFF << S)) | 0x4B000000
    else:
        S: tl.constexpr = 8 * (C % 16) + 4 * (C // 16)  # the nibble's place in the halfword
        bits = (qs & (0xF << S)) | 0x4B000000
        if TYPE == 6 or TYPE == 7:  # the fifth bit, from bit C of qh_h to bit S + 4
            if C < S + 4:
                bits = bits | ((qh_h << (S + 4 - C)) & (0x10 << S))
            else:
                bits = bits | ((qh_h >> (C - S - 4)) & (0x10 << S))
    if TYPE == 20:
        return iq4_value(exact_code(bits, S))
    return exact_code(bits, S)


@triton.jit
def masked_load(ptr, ok, MASKED: tl.constexpr):
    """A load, masked (other 0) only where the launch is not EVEN (no masks: no predicates and
    no zeroing of the registers before each load; gguf_kgemv.py's GEMVs too)."""
    if MASKED:
        return tl.load(ptr, mask=ok, other=0)
    return tl.load(ptr)


@triton.jit
def _block_sums(block, x_h, h, ok, x_ok, TYPE: tl.constexpr, HW: tl.constexpr,
                MASKED: tl.constexpr):
    """One block's float32 sums [BLOCK_N, NQ] for each output (`block` [BLOCK_N, 1] int16
    pointers) and halfword of codes h, x_h: the inputs of each halfword's weight 2h."""
    QS: tl.constexpr = HW - (16 if TYPE == 8 else 8)  # the codes: the block's last 16 bytes (32)
    qs = masked_load(block + QS + h[None, :], ok, MASKED).to(tl.int32)
    d = masked_load(block, ok, MASKED).to(tl.float16, bitcast=True).to(tl.float32)
    qh_h = qs  # (unused but by Q5)
    if TYPE == 6 or TYPE == 7:  # 32 fifth bits in two halfwords after d (and m)
        qh_lo = masked_load(block + (HW - 10), ok, MASKED).to(tl.int32)
        qh_hi = masked_load(block + (HW - 9), ok, MASKED).to(tl.int32)
        qh_h = ((qh_lo & 0xFFFF) | (qh_hi << 16)) >> (2 * h)[None, :]
    tile = tl.zeros(qs.shape, tl.float32)
    x_sum = tl.zeros([1, qs.shape[1]], tl.float32)
    if TYPE == 8:
        for c in tl.static_range(2):
            x_c = masked_load(x_h + c, x_ok, MASKED).to(tl.float32)[None, :]
            tile = tl.fma(x_c, _code(qs, qh_h, c, TYPE), tile)
            x_sum += x_c
    else:
        for c in tl.static_range(4):  # weights 2h, 2h + 1, 2h + 16, 2h + 17
            x_c = masked_load(x_h + (c % 2 + 16 * (c // 2)), x_ok, MASKED).to(tl.float32)[None, :]
            tile = tl.fma(x_c, _code(qs, qh_h, c % 2 + 16 * (c // 2), TYPE), tile)
            x_sum += x_c
    if TYPE == 3 or TYPE == 7:  # d * q + m
        m = masked_load(block + 1, ok, MASKED).to(tl.float16, bitcast=True).to(tl.float32)
        return d * tile + m * x_sum
    if TYPE == 20:  # (x_sum unused: the compiler drops it)
        return d * tile
    OFFSET: tl.constexpr = 8 if TYPE == 2 else (16 if TYPE == 6 else 128)
    return d * (tile - OFFSET * x_sum)


@triton.jit
def classic_gemv(x_ptr, w_ptr, n, n_ok, k_start, k_end, stride_wn,
                 TYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
                 UNROLL: tl.constexpr, EVEN: tl.constexpr):
    """One row's float32 sums [1, BLOCK_N] over inputs [k_start, k_end) (whole blocks of 32)
    of x (the row's first input at x_ptr) times the outputs n's blocks (uint8 rows of
    `stride_wn` bytes at w_ptr), UNROLL blocks a step (the pointer arithmetic shared). EVEN:
    N a multiple of BLOCK_N and every split a multiple of UNROLL blocks, so no load is masked."""
    HW: tl.constexpr = BLOCK_BYTES // 2  # halfwords a block
    NQ: tl.constexpr = 16 if TYPE == 8 else 8
    h = tl.arange(0, NQ)
    block = (w_ptr.to(tl.pointer_type(tl.int16)) + n.to(tl.int64)[:, None] * (stride_wn // 2)
             + (k_start // 32) * HW)  # [BLOCK_N, 1]: each output's block
    x_h = x_ptr + k_start + 2 * h  # [NQ]: the input of each halfword's weight 2h
    acc = tl.zeros([BLOCK_N, NQ], tl.float32)
    for k0 in range(k_start, k_end, 32 * UNROLL):
        for u in tl.static_range(UNROLL):
            if u == 0:
                ok = n_ok[:, None]
                x_ok = h >= 0
            else:  # a split's last step may hold fewer blocks (tensor masks: see quant_gemm)
                ok = n_ok[:, None] & (n[:, None] * 0 + k0 + 32 * u < k_end)
                x_ok = h * 0 + k0 + 32 * u < k_end
            acc += _block_sums(block + u * HW, x_h + 32 * u, h, ok, x_ok, TYPE, HW, not EVEN)
        block += UNROLL * HW
        x_h += 32 * UNROLL
    return tl.sum(acc, 1)[None, :]


def classic_gemv_even(n: int, k: int, block_n: int, k_per_split: int, unroll: int) -> bool:
    """classic_gemv's EVEN for an [n, k] weight: no output tile and no split ragged."""
    step = 32 * unroll
    return n % block_n == 0 and k % step == 0 and k_per_split % step == 0
