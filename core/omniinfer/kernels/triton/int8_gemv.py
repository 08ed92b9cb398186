"""The one-row decode product of int8 layers in Triton (W8A16, and W8A8 on its int8 activation
codes), for int8_gemm.py's ``int8_matmul``: int8 weights [N, K] read as int32 words, four
codes a word.

Each word has its codes' top bits flipped (the code + 128, unsigned) and is ORed with the bits
of 2**23 (`magic`, passed at run time: see wn_gemv.placed_code) once; each code is then one AND
and one add, the exact float ``(code + 128) * 2**s`` (s 0 or 8: bytes 2 and 3 come from the
word shifted right by 16), and its input is scaled by 2**-s (exact, but for an input below
~2**-100, which may flush to zero far under the sum's float32 resolution). The float32 sums
``sum(x * (code + 128)) - 128 * sum(x)`` are the exact-code products int8_matmul's W8A16 tile
computes, in another order (W8A8: its exact int32 sums); the scale is applied once an output
by the caller.
"""

from __future__ import annotations

import triton
import triton.language as tl

from omniinfer.kernels.triton.wn_gemv import code_place, placed_code

INTERPRETED = bool(triton.knobs.runtime.interpret)  # fixed when the kernels below are defined
# W8A8 exactness: a sum of float32 products is exact while below 2**24; each of acc's elements
# sums k_per_split / (BLOCK_K / 4) products of |x code| <= 128 and code + 128 <= 255
EXACT_SPLIT = (1 << 24) // (128 * 255) * 16  # inputs a split, for BLOCK_K 64 (16 words)


@triton.jit
def int8_gemv(x_ptr, w_ptr, n, n_ok, k_start, k_end, stride_wn, magic,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
              INT8_X: tl.constexpr):
    """One row's sums [1, BLOCK_N] over inputs [k_start, k_end) of x (the row's first input at
    x_ptr) times the int8 codes of outputs n (rows of `stride_wn` bytes at w_ptr, 4-byte aligned;
    K a multiple of 4), BLOCK_K inputs a step. EVEN: N a multiple of BLOCK_N and every split a
    multiple of BLOCK_K, so no load is masked. INT8_X (W8A8): x holds int8 codes and the sums
    are exact: every float32 product and partial sum is an integer below 2**24 while a split
    covers at most EXACT_SPLIT inputs (the launcher's bound), and they are summed across the
    words as int32 (returned as float32, as the reference makes its int32 sum float)."""
    KW: tl.constexpr = BLOCK_K // 4
    i = tl.arange(0, KW)
    words_ptr = (w_ptr.to(tl.pointer_type(tl.int32)) + n.to(tl.int64)[:, None] * (stride_wn // 4)
                 + k_start // 4 + i[None, :])  # [BLOCK_N, KW]
    x_i = x_ptr + k_start + 4 * i  # [KW]: each word's first input
    acc = tl.zeros([BLOCK_N, KW], tl.float32)
    x_sum = tl.zeros([1, KW], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN:
            words = tl.load(words_ptr)
        else:
            k_ok = k0 + 4 * i < k_end
            words = tl.load(words_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0)
        words = words ^ -0x7F7F7F80  # (0x80808080) each int8 code + 128, an unsigned byte
        low = words | magic
        high = (words >> 16) | magic
        for b in tl.static_range(4):  # byte b: of low (b 0, 1) or high (2, 3), at bit 8 (b % 2)
            code = placed_code(low, high, b, 8)  # (code + 128) * 2**s
            if EVEN:
                x_b = tl.load(x_i + b).to(tl.float32)[None, :]
            else:
                x_b = tl.load(x_i + b, mask=k_ok, other=0).to(tl.float32)[None, :]
            acc = tl.fma(x_b * (1.0 / (1 << code_place(b, 8))), code, acc)  # times x * 2**-s
            x_sum += x_b
        words_ptr += KW
        x_i += BLOCK_K
    if INT8_X:  # integers below 2**24: exact in float32, summed as int32, then made float32
        total = tl.sum((acc - 128.0 * x_sum).to(tl.int32), 1).to(tl.float32)  # (as the
    else:  # reference's int32 sum .float(): one rounding of the exact sum)
        total = tl.sum(acc - 128.0 * x_sum, 1)
    return total[None, :]


def int8_gemv_even(n: int, k: int, block_n: int, block_k: int, k_per_split: int) -> bool:
    """int8_gemv's EVEN for an [n, k] weight: no output tile and no split ragged."""
    return n % block_n == 0 and k % block_k == 0 and k_per_split % block_k == 0
