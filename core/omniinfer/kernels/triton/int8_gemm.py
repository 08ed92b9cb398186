"""int8 linear layers in Triton: int8 weights [N, K] (as checkpoints and int8-at-load store them)
with a float32 scale per output; activations either quantized to int8 per token (dynamic) or
with a static per-tensor scale (``quantize_int8_rows``), multiplied exactly in int32 and scaled
once (W8A8), or left in float with the weights converted in registers (W8A16).

The tiles, the K split and the launch are quant_gemm.py's (``launch_weight_only``'s protocol).
Written for NVIDIA, AMD and Intel Triton and the CPU interpreter, as quant_gemm.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omniinfer.kernels.triton.int8_gemv import EXACT_SPLIT, int8_gemv, int8_gemv_even
from omniinfer.kernels.triton.quant_gemm import (
    INTERPRETED,
    launch_weight_only,
    matrix_rows,
    program_tile,
    split_k,
    store_out,
)


@triton.jit
def _int8_matmul_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split, stride_xm, stride_om, stride_os, stride_wn, magic,
    INT8_ACTIVATIONS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
    ROUND_BF16: tl.constexpr, ONE_ROW: tl.constexpr = False, EVEN: tl.constexpr = False,
):
    """launch_weight_only's protocol: one program a tile of rows x outputs x one K split.
    ONE_ROW: the one-row GEMV (int8_gemv.py; `magic` 0x4B000000 at run time)."""
    pid_m, split, rows, n, k_start, k_end = program_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    rows_ok = rows < M
    n_ok = n < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + n.to(tl.int64)[None, :] * stride_wn
    if ONE_ROW:
        result = int8_gemv(x_ptr + pid_m.to(tl.int64) * stride_xm, w_ptr, n, n_ok, k_start,
                           k_end, stride_wn, magic, BLOCK_N, BLOCK_K, EVEN, INT8_ACTIVATIONS)
        if INT8_ACTIVATIONS:  # the exact int32 sums (as float32), scaled by the row's scale
            result = result * tl.load(x_scale_ptr + pid_m)
    elif INT8_ACTIVATIONS:  # exact: int8 x int8 products summed in int32 (per K split)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_end
            x = tl.load(x_rows + k[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0)
            w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
            acc += tl.dot(x, w, out_dtype=tl.int32)
        x_scale = tl.load(x_scale_ptr + rows, mask=rows_ok, other=0.0)
        result = acc.to(tl.float32) * x_scale[:, None]
    else:  # weight-only: int8 weights converted in registers
        result = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_end
            x = tl.load(x_rows + k[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
            # |code| <= 128: exact in every float dtype (through float32: the interpreter
            # converts int8 to bfloat16 wrongly)
            w = w.to(tl.float32).to(x_ptr.dtype.element_ty)
            if DOT_F32:
                result += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                result += tl.dot(x, w, input_precision="ieee")
    result = result * tl.load(w_scale_ptr + n, mask=n_ok, other=0.0)[None, :]
    store_out(result, bias_ptr, out_ptr, rows, rows_ok, n, n_ok, split, stride_om, stride_os,
              HAS_BIAS, ROUND_BF16)


@triton.jit
def _quantize_int8_rows_kernel(
    x_ptr, q_ptr, scale_ptr, static_scale_ptr, K, stride_xm, stride_qm,
    IS_STATIC: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    if IS_STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0), 1e-10) / 127.0
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_row + k, mask=k < K, other=0.0).to(tl.float32) / scale
        r = tl.floor(v + 0.5)  # round half to even, as torch.round: a tie that went odd goes back
        r = tl.where((r - v == 0.5) & (r % 2 != 0), r - 1.0, r)
        r = tl.minimum(tl.maximum(r, -128.0), 127.0)
        tl.store(q_ptr + row * stride_qm + k, r.to(tl.int8), mask=k < K)


# ---- launchers -----------------------------------------------------------------------------
def quantize_int8_rows(x: torch.Tensor, static_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [M, K], float32 scale [M]) of x [M, K]: ``round(x / scale)`` clamped to
    [-128, 127], scale = max|row| / 127 per row, or `static_scale` ([1]) for every row."""
    x2 = matrix_rows(x)
    m, k = x2.shape
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        _quantize_int8_rows_kernel[(m,)](
            x2, q, scale, scale if static_scale is None else static_scale, k, x2.stride(0),
            q.stride(0), IS_STATIC=static_scale is not None,
            BLOCK_K=min(1024, triton.next_power_of_2(k)), num_warps=4)
    return q, scale


def int8_tiles(m: int, n: int, k: int, float32_dot: bool = False, programs: int = 512) -> dict:
    """`int8_matmul`'s launch configuration for an [m, k] x [k, n] product: 64 x 64 output
    tiles (tl.dot needs 16 or more of each), and K split until about `programs` run where the
    tiles alone are fewer (Llama-3-8B's down, 4096 outputs, was 64 programs at decode: 0.37x
    the dense product's speed on an H200, 2026-12-04; its gate_up, 448 tiles, ran at 1.0x).
    `float32_dot` (W8A16 on float32 activations: FMAs on register tiles) takes wn_tiles' tile
    that does not spill on NVIDIA, K 32 on 8 warps (python -m omniinfer.testing.kernels_aot)."""
    wide = float32_dot and not INTERPRETED
    block_m = min(32 if wide else 64, max(16, triton.next_power_of_2(m)))
    block_k = 32 if wide else 64
    split, k_per_split = split_k(triton.cdiv(n, 64) * triton.cdiv(m, block_m), k, block_k, programs)
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, split_k=split,
                k_per_split=k_per_split, num_warps=8 if wide else 4)


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None = None, quantize_activations: bool = True,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None]).T (+ bias)`` for int8 `weight` [N, K] and
    float32 `weight_scale` [N]. With `quantize_activations` (W8A8), x is quantized to int8 per
    token (or with the static `input_scale`) and the product is exact int32 (per K split: the
    splits' scaled sums are added in float32); otherwise (W8A16) x stays in its float dtype.
    Returns [..., N] in x's dtype."""
    x2 = matrix_rows(x)
    m, k = x2.shape
    n = weight.shape[0]
    check_int8_weight(weight, k)
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    a, a_scale = (quantize_int8_rows(x2, input_scale) if quantize_activations
                  else (x2, weight_scale))
    one_row = (m == 1 and k % 4 == 0 and weight.data_ptr() % 4 == 0
               and weight.stride(0) % 4 == 0)  # int8_gemv.py's words: 4-byte aligned rows
    if one_row:
        cfg = one_row_tiles(n, k)
        # W8A8: exact while a split sums at most EXACT_SPLIT inputs (else the tl.dot tile)
        one_row = not quantize_activations or cfg["k_per_split"] <= EXACT_SPLIT
    if one_row:
        even = int8_gemv_even(n, k, cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["k_per_split"])
    else:
        cfg = int8_tiles(m, n, k, x.dtype == torch.float32 and not quantize_activations)
        even = False
    return launch_weight_only(_int8_matmul_kernel, x, a, (a_scale, weight, weight_scale),
                              (weight.stride(0), 0x4B000000), n, cfg, bias,
                              INT8_ACTIVATIONS=quantize_activations, ONE_ROW=one_row, EVEN=even)


def one_row_tiles(n: int, k: int, block_n: int = 128, programs: int = 2048) -> dict:
    """The W8A16 one-row GEMV's launch configuration: 128 outputs x 64 inputs a step, K split
    until about `programs` run (the GGUF GEMV's choice). Not yet timed on a GPU; the sm_90
    estimate (benchmarks/gemv_sass.py, Llama-3-8B gate_up) is 39.1 us at 64 outputs, 29.8 at
    128, 25.5 at 256 (the weight's read at 4.8 TB/s: 24.5)."""
    split, k_per_split = split_k(triton.cdiv(n, block_n), k, 64, programs)
    return dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=64, split_k=split, k_per_split=k_per_split,
                num_warps=4)


def check_int8_weight(weight: torch.Tensor, k: int) -> None:
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight must be int8 [N, {k}] with contiguous rows, got "
                         f"{weight.dtype} {tuple(weight.shape)} strides {weight.stride()}")
