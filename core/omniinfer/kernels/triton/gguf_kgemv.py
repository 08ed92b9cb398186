"""The one-row decode products of GGUF's K-quant blocks in Triton (Q4_K and Q5_K in words;
Q6_K and Q3_K in halfwords, Q2_K and IQ4_XS in words, below), on the file's own blocks (gguf_gemv.py
holds the classic types', gguf_gemm.py every other case).

A Q4_K block (144 bytes) and a Q5_K block (176) are whole int32 words: d and dmin (word 0),
twelve bytes of 6-bit scales and minimums (words 1-3), Q5_K's 32 bytes of fifth bits, then 128
bytes of nibbles, 32 bytes (8 words) a 64-weight chunk: the low nibbles the chunk's first
sub-block of 32, the high its second. A program reads a block's chunk as words [BLOCK_N, 8]
and takes the eight nibbles of each word one position at a time (wn_gemv.placed_code: the
word ORed once with 2**23's bits, then one AND and one add a code give the exact float code *
2**s, and its input is scaled by 2**-s), each with its input; per sub-block it keeps the sums
of ``x * q`` and of ``x`` apart and applies ``d * scale`` and ``dmin * min`` once an output:
``sum(x * w) = d * sc * sum(x * q) - dmin * m * sum(x)``. The blocks must be 4-byte aligned
(gguf_matmul sends others to gguf_gemm.py's byte decoder).

The sums are float32; the weights are never rounded to x's dtype (the reference rounds each
``d * sc * q - dmin * m`` to it), as the other GEMVs (docs/quantization.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from omniinfer.kernels.triton.gguf_gemv import iq4_value
from omniinfer.kernels.triton.gguf_gemv import masked_load as _ld
from omniinfer.kernels.triton.wn_gemv import code_place, packed_code, placed_code

INTERPRETED = bool(triton.knobs.runtime.interpret)  # fixed when the kernels below are defined


@triton.jit
def _byte_float(v, B: tl.constexpr):
    """Byte B of int32 `v` [BLOCK_N, 1] as an exact float32 (its bits ORed into 2**23's)."""
    return ((v >> (8 * B)) & 0xFF | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _scale_min(w1, w2, w3, S: tl.constexpr):
    """Sub-block S's 6-bit scale and minimum as float32 [BLOCK_N, 1], from the scale words
    w1, w2, w3 (bytes 4-15 of the block): sub-blocks 0-3 the low 6 bits of bytes S and 4 + S;
    4-7 a nibble of byte 8 + i and the top two bits of bytes i and 4 + i, i = S - 4."""
    if S < 4:
        sc = _byte_float(w1 & 0x3F3F3F3F, S)
        mn = _byte_float(w2 & 0x3F3F3F3F, S)
    else:
        sc = _byte_float((w3 & 0x0F0F0F0F) | ((w1 >> 2) & 0x30303030), S - 4)
        mn = _byte_float(((w3 >> 4) & 0x0F0F0F0F) | ((w2 >> 2) & 0x30303030), S - 4)
    return sc, mn


@triton.jit
def _q5_code(low, high, qh, P: tl.constexpr, BIT: tl.constexpr):
    """placed_code(low, high, P, 4) with bit BIT of `qh` as the code's fifth bit."""
    S: tl.constexpr = code_place(P, 4)
    if 4 * P + 4 > 23:
        bits = high & ((0xF << S) | 0x4B000000)
    else:
        bits = low & ((0xF << S) | 0x4B000000)
    if S + 4 >= BIT:
        bits = bits | ((qh << (S + 4 - BIT)) & (0x10 << S))
    else:
        bits = bits | ((qh >> (BIT - S - 4)) & (0x10 << S))
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _first_blocks(w_ptr, n, k_start, stride_wn, UNITS: tl.constexpr, UNIT: tl.constexpr):
    """Each output's block that holds input k_start (a multiple of 256) [BLOCK_N, 1], as pointers
    to UNIT-byte words (4: int32, 2: int16), a block being UNITS of them."""
    if UNIT == 4:
        rows = w_ptr.to(tl.pointer_type(tl.int32))
    else:
        rows = w_ptr.to(tl.pointer_type(tl.int16))
    return rows + n.to(tl.int64)[:, None] * (stride_wn // UNIT) + (k_start // 256) * UNITS


@triton.jit
def kquant_gemv(x_ptr, w_ptr, n, n_ok, k_start, k_end, stride_wn, magic,
                TYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
                EVEN: tl.constexpr):
    """One row's float32 sums [1, BLOCK_N] over inputs [k_start, k_end) (whole blocks of 256)
    of x (the row's first input at x_ptr) times the outputs n's Q4_K / Q5_K blocks (uint8 rows
    of `stride_wn` bytes at w_ptr, a multiple of 4). EVEN: N a multiple of BLOCK_N (no mask)."""
    WB: tl.constexpr = BLOCK_BYTES // 4  # words a block
    QS: tl.constexpr = 4 if TYPE == 12 else 12  # the nibbles' first word
    MASKED: tl.constexpr = not EVEN
    i = tl.arange(0, 8)
    ok = n_ok[:, None]
    block = _first_blocks(w_ptr, n, k_start, stride_wn, WB, 4)  # [BLOCK_N, 1]
    x_i = x_ptr + k_start + 4 * i  # [8]: the input of byte 0 of each word's low nibbles
    acc = tl.zeros([BLOCK_N, 8], tl.float32)
    for _ in range(k_start, k_end, 256):
        head = _ld(block, ok, MASKED)
        d = (head & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (head >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        w1 = _ld(block + 1, ok, MASKED)
        w2 = _ld(block + 2, ok, MASKED)
        w3 = _ld(block + 3, ok, MASKED)
        if TYPE == 13:  # Q5_K: weight l of every sub-block s has its fifth bit at bit s of
            qh = _ld(block + 4 + i[None, :], ok, MASKED)  # byte l: word l // 4, bit 8 (l % 4) + s
        else:
            qh = i[None, :]
        for j in tl.static_range(4):  # 64-weight chunks: sub-blocks 2j (low) and 2j + 1 (high)
            words = _ld(block + QS + 8 * j + i[None, :], ok, MASKED)
            low = words | magic
            high = (words >> 16) | magic
            t_lo = tl.zeros([BLOCK_N, 8], tl.float32)
            t_hi = tl.zeros([BLOCK_N, 8], tl.float32)
            xs_lo = tl.zeros([1, 8], tl.float32)
            xs_hi = tl.zeros([1, 8], tl.float32)
            for p in tl.static_range(8):  # nibble p of a word: byte p // 2, high if p odd
                if TYPE == 13:  # the fifth bit: bit 8 (p // 2) + 2j + p % 2 of qh
                    code = _q5_code(low, high, qh, p, 8 * (p // 2) + 2 * j + p % 2)
                else:
                    code = placed_code(low, high, p, 4)  # code * 2**s
                x_p = tl.load(x_i + (64 * j + 32 * (p % 2) + p // 2)).to(tl.float32)[None, :]
                # x * 2**-s: exact, but for an x below ~2**-100 (may flush to zero: far under
                # the float32 resolution of the sum)
                x_s = x_p * (1.0 / (1 << code_place(p, 4)))
                if p % 2 == 0:
                    t_lo = tl.fma(x_s, code, t_lo)
                    xs_lo += x_p
                else:
                    t_hi = tl.fma(x_s, code, t_hi)
                    xs_hi += x_p
            sc_lo, m_lo = _scale_min(w1, w2, w3, 2 * j)
            sc_hi, m_hi = _scale_min(w1, w2, w3, 2 * j + 1)
            acc += ((d * sc_lo) * t_lo - (dmin * m_lo) * xs_lo
                    + (d * sc_hi) * t_hi - (dmin * m_hi) * xs_hi)
        block += WB
        x_i += 256
    return tl.sum(acc, 1)[None, :]


@triton.jit
def _halfword_blocks(x_ptr, w_ptr, n, n_ok, k_start, stride_wn, HW: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """What a halfword K-quant GEMV (blocks of HW halfwords) starts from: i = 0..7, the outputs'
    mask [BLOCK_N, 1], each output's first block [BLOCK_N, 1] (int16 pointers), the inputs
    x_ptr + k_start + 2i [8], and its float32 sums [BLOCK_N, 8]."""
    i = tl.arange(0, 8)
    block = _first_blocks(w_ptr, n, k_start, stride_wn, HW, 2)
    return (i, n_ok[:, None], block, x_ptr + k_start + 2 * i,
            tl.zeros([BLOCK_N, 8], tl.float32))


@triton.jit
def _q6_code(low, qh_s, E: tl.constexpr, HIGH: tl.constexpr):
    """A Q6_K code times 2**s (s = 8E, + 4 for a high nibble), exact: the nibble of byte E of
    `low` (halfwords of low bits ORed with 2**23's) and two bits of `qh_s` (the halfword of
    high bits shifted so that they sit at s + 4)."""
    S: tl.constexpr = 8 * E + 4 * HIGH
    bits = (low & ((0xF << S) | 0x4B000000)) | (qh_s & (0x30 << S))
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def q6k_gemv(x_ptr, w_ptr, n, n_ok, k_start, k_end, stride_wn, magic,
             BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """kquant_gemv for Q6_K blocks (210 bytes: halfwords, 2-byte aligned): 128 bytes of low
    nibbles, 64 of high bit pairs, 16 int8 scales, d. For each half n2 of a block and each
    group g of 16 weights, halfwords u = 8g + i (i 0..7) of the half's low bits (ql_a: weights
    l = 2u, 2u + 1; ql_b: l + 32) and high bits give weights 128 n2 + 32 t + l, t 0..3 (t 0, 1
    the low nibbles of ql_a, ql_b; 2, 3 their high), whose scale is 8 n2 + g + 2t:
    ``sum(x * w) = d * sum_t sc_t * (sum(x * q_t) - 32 * sum(x_t))``."""
    MASKED: tl.constexpr = not EVEN
    i, ok, block, x_i, acc = _halfword_blocks(x_ptr, w_ptr, n, n_ok, k_start, stride_wn, 105,
                                              BLOCK_N)
    for _ in range(k_start, k_end, 256):
        d = _ld(block + 104, ok, MASKED).to(tl.float16, bitcast=True).to(tl.float32)
        for n2 in tl.static_range(2):
            for g in tl.static_range(2):
                u = 8 * g + i[None, :]
                low_a = _ld(block + 32 * n2 + u, ok, MASKED).to(tl.int32) | magic
                low_b = _ld(block + 32 * n2 + 16 + u, ok, MASKED).to(tl.int32) | magic
                qh = _ld(block + 64 + 16 * n2 + u, ok, MASKED).to(tl.int32)
                qh4 = qh << 4  # bits 8e + 0..1 (t 0) and 8e + 4..5 (t 2) to 8e + 4.. / 8e + 8..
                qh2 = qh << 2  # bits 8e + 2..3 (t 1) and 8e + 6..7 (t 3) likewise
                for t in tl.static_range(4):
                    sums = tl.zeros([BLOCK_N, 8], tl.float32)
                    x_sum = tl.zeros([1, 8], tl.float32)
                    for e in tl.static_range(2):
                        if t % 2 == 0:
                            code = _q6_code(low_a, qh4, e, t // 2)
                        else:
                            code = _q6_code(low_b, qh2, e, t // 2)
                        x_e = tl.load(x_i + (128 * n2 + 16 * g + 32 * t + e)).to(tl.float32)
                        x_e = x_e[None, :]
                        # x * 2**-s: exact, but for an x below ~2**-100 (see kquant_gemv)
                        sums = tl.fma(x_e * (1.0 / (1 << (8 * e + 4 * (t // 2)))), code, sums)
                        x_sum += x_e
                    # int8 scale 8 n2 + g + 2t: byte g of halfword 96 + 4 n2 + t, made an exact
                    # float by its bits (top bit flipped: + 128), not by a conversion
                    sc = _ld(block + (96 + 4 * n2 + t), ok, MASKED).to(tl.int32)
                    sc = ((((sc >> (8 * g)) & 0xFF) ^ 0x80) | 0x4B000000).to(tl.float32,
                                                                          bitcast=True)
                    acc += (d * (sc - 8388736.0)) * (sums - 32.0 * x_sum)
        block += 105
        x_i += 256
    return tl.sum(acc, 1)[None, :]



@triton.jit
def _q3_scale(block, s: tl.constexpr, ok, MASKED: tl.constexpr):
    """Q3_K's 6-bit scale s (0-15) less 32, float32 [BLOCK_N, 1]: its low 4 bits from byte
    96 + s % 8 (shifted by 4 (s // 8)), its top 2 from byte 104 + s % 4 (by 2 (s // 4))."""
    lo = _ld(block + (48 + (s % 8) // 2), ok, MASKED).to(tl.int32)
    hi = _ld(block + (52 + (s % 4) // 2), ok, MASKED).to(tl.int32)
    lo = (lo >> (8 * ((s % 8) % 2) + 4 * (s // 8))) & 15
    hi = (hi >> (8 * ((s % 4) % 2) + 2 * (s // 4))) & 3
    return ((lo | (hi << 4)) | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0


@triton.jit
def q3k_gemv(x_ptr, w_ptr, n, n_ok, k_start, k_end, stride_wn, magic,
             BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """kquant_gemv for Q3_K blocks (110 bytes: halfwords): 32 bytes of high bits (hmask), 64
    of 2-bit codes, 12 of 6-bit scales, d. Weight 128 n2 + 32 j + l (l = 16 g + 2 i + e) has
    bits 2j of code byte 32 n2 + l, its third bit bit 4 n2 + j of hmask byte l, and scale
    8 n2 + 2 j + g: ``sum(x * w) = d * sum (sc - 32) * (sum(x * q) - 4 * sum(x))``, q the
    3-bit code (the reference's ``q - 4`` where the high bit is clear)."""
    MASKED: tl.constexpr = not EVEN
    i, ok, block, x_i, acc = _halfword_blocks(x_ptr, w_ptr, n, n_ok, k_start, stride_wn, 55,
                                              BLOCK_N)
    for _ in range(k_start, k_end, 256):
        d = _ld(block + 54, ok, MASKED).to(tl.float16, bitcast=True).to(tl.float32)
        for g in tl.static_range(2):
            # hmask halfwords 8g + i (bytes l = 16 g + 2 i + e), shared by both halves
            hm = _ld(block + 8 * g + i[None, :], ok, MASKED).to(tl.int32)
            for n2 in tl.static_range(2):
                low = _ld(block + 16 + 16 * n2 + 8 * g + i[None, :], ok, MASKED).to(tl.int32)
                low = low | magic
                for j in tl.static_range(4):
                    sums = tl.zeros([BLOCK_N, 8], tl.float32)
                    x_sum = tl.zeros([1, 8], tl.float32)
                    for e in tl.static_range(2):
                        # the code's two bits at S = 8e + 2j, its third (hmask bit 8e + 4 n2 + j)
                        # moved beside them, to S + 2
                        if j + 2 >= 4 * n2:
                            high = (hm << (j + 2 - 4 * n2)) & (4 << (8 * e + 2 * j))
                        else:
                            high = (hm >> (4 * n2 - j - 2)) & (4 << (8 * e + 2 * j))
                        bits = (low & ((3 << (8 * e + 2 * j)) | 0x4B000000)) | high
                        code = bits.to(tl.float32, bitcast=True) - 8388608.0  # q * 2**S
                        x_e = tl.load(x_i + (128 * n2 + 32 * j + 16 * g + e)).to(tl.float32)
                        x_e = x_e[None, :]
                        # x * 2**-S: exact, but for an x below ~2**-100 (see kquant_gemv)
                        sums = tl.fma(x_e * (1.0 / (1 << (8 * e + 2 * j))), code, sums)
                        x_sum += x_e
                    sc = _q3_scale(block, 8 * n2 + 2 * j + g, ok, MASKED)
                    acc += (d * sc) * (sums - 4.0 * x_sum)
        block += 55
        x_i += 256
    return tl.sum(acc, 1)[None, :]


@triton.jit
def q2k_gemv(x_ptr, w_ptr, n, n_ok, k_start, k_end, stride_wn, magic,
             BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """kquant_gemv for Q2_K blocks (84 bytes: 21 words): 16 bytes of scales (4-bit scale, 4-bit
    minimum), 64 of 2-bit codes, d and dmin. Weight 128 n2 + 32 j + l (l = 16 g + 4 i + b) has
    bits 2j of code byte 32 n2 + l (byte b of word 4 + 8 n2 + 4 g + i) and scale byte 8 n2 + 2 j
    + g: ``sum(x * w) = d * sc * sum(x * q) - dmin * m * sum(x)`` per 16 weights."""
    MASKED: tl.constexpr = not EVEN
    i = tl.arange(0, 4)
    ok = n_ok[:, None]
    block = _first_blocks(w_ptr, n, k_start, stride_wn, 21, 4)  # [BLOCK_N, 1]
    x_i = x_ptr + k_start + 4 * i  # [4]: the input of byte 0 of each word
    acc = tl.zeros([BLOCK_N, 4], tl.float32)
    for _ in range(k_start, k_end, 256):
        dd = _ld(block + 20, ok, MASKED)
        d = (dd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = (dd >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        for n2 in tl.static_range(2):
            for g in tl.static_range(2):
                words = _ld(block + (4 + 8 * n2 + 4 * g) + i[None, :], ok, MASKED)
                low = words | magic
                high = (words >> 16) | magic
                for j in tl.static_range(4):
                    sums = tl.zeros([BLOCK_N, 4], tl.float32)
                    x_sum = tl.zeros([1, 4], tl.float32)
                    for b in tl.static_range(4):  # code 4b + j of the word: bits 8b + 2j
                        code = placed_code(low, high, 4 * b + j, 2)  # code * 2**s
                        x_b = tl.load(x_i + (128 * n2 + 32 * j + 16 * g + b)).to(tl.float32)
                        x_b = x_b[None, :]
                        # x * 2**-s: exact, but for an x below ~2**-100 (see kquant_gemv)
                        sums = tl.fma(x_b * (1.0 / (1 << code_place(4 * b + j, 2))), code, sums)
                        x_sum += x_b
                    s = 8 * n2 + 2 * j + g  # scale byte s: word s // 4, byte s % 4
                    sm = _ld(block + s // 4, ok, MASKED)
                    sc = _byte_float(sm & 0x0F0F0F0F, s % 4)
                    mn = _byte_float((sm >> 4) & 0x0F0F0F0F, s % 4)
                    acc += (d * sc) * sums - (dmin * mn) * x_sum
        block += 21
        x_i += 256
    return tl.sum(acc, 1)[None, :]


@triton.jit
def _iq4xs_scale(d, head, low_scales, J):
    """d times IQ4_XS sub-block J's scale less 32, float32 (J [1, 8], the sub-block of each
    column: [BLOCK_N, 8]): its 6 bits the nibble at bit 4J of `low_scales` and, above them, bits
    16 + 2J of `head` (both [BLOCK_N, 1])."""
    ls = ((low_scales >> (4 * J)) & 15) | (((head >> (16 + 2 * J)) & 3) << 4)
    return d * ((ls | 0x4B000000).to(tl.float32, bitcast=True) - 8388640.0)


@triton.jit
def iq4xs_gemv(x_ptr, w_ptr, n, n_ok, k_start, k_end, stride_wn,
               BLOCK_N: tl.constexpr, EVEN: tl.constexpr):
    """kquant_gemv for IQ4_XS blocks (136 bytes: 34 words): d and the scales' high bit pairs
    (word 0), their low nibbles (word 1), then eight sub-blocks of 32 weights, 16 bytes (4
    words) each, byte l's low nibble weight 32 j + l and its high nibble 32 j + 16 + l, each an
    index into IQ4_VALUES (gguf_gemv.iq4_value computes the entry). The eight sub-blocks are
    the columns of the tiles [BLOCK_N, 8]: word w of each a step, so each sub-block's
    ``sum(x * IQ4_VALUES[q])`` is one column's, multiplied by ``d * (ls - 32)`` (ls its 6-bit
    scale) once a block."""
    MASKED: tl.constexpr = not EVEN
    j = tl.arange(0, 8)
    ok = n_ok[:, None]
    block = _first_blocks(w_ptr, n, k_start, stride_wn, 34, 4)  # [BLOCK_N, 1]
    x_j = x_ptr + k_start + 32 * j  # [8]: each sub-block's first input
    acc = tl.zeros([BLOCK_N, 8], tl.float32)
    for _ in range(k_start, k_end, 256):
        tile = tl.zeros([BLOCK_N, 8], tl.float32)
        for w in tl.static_range(4):
            words = _ld(block + 2 + w + 4 * j[None, :], ok, MASKED)
            words_high = words >> 16
            for p in tl.static_range(8):  # nibble p of a word: byte p // 2, high if p odd
                code = iq4_value(packed_code(words, words_high, p, 4))
                x_p = tl.load(x_j + (4 * w + p // 2 + 16 * (p % 2))).to(tl.float32)[None, :]
                tile = tl.fma(x_p, code, tile)
        head = _ld(block, ok, MASKED)  # d | scales_h << 16
        d = (head & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        low_scales = _ld(block + 1, ok, MASKED)  # sub-block j's low nibble at bit 4j
        acc += _iq4xs_scale(d, head, low_scales, j[None, :]) * tile
        block += 34
        x_j += 256
    return tl.sum(acc, 1)[None, :]
