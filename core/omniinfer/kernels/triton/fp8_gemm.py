"""FP8 (e4m3) weights in Triton, as FP8 checkpoints hold them (quantization/fp8.py's piece):
codes ``q`` uint8 [N, K] and float32 scales ``scale`` [N, ceil(K / scale_cols)], a scale per
output and block of `scale_cols` inputs (128 for ``weight_block_size`` [128, 128]; K for one
scale a row). Activations stay float (weight-only: what vLLM runs on GPUs without FP8 arithmetic,
and what the reference and the CPU kernel compute; no GPU's FP8 units are used).

A code becomes its value in registers with a few integer operations and no table: its sign moved
to bit 15 and its exponent and mantissa to bits 7-14 make a float16 whose exponent bias (15)
exceeds e4m3's (7) by 8, so that float16 is the e4m3 value times 2**-8 exactly, subnormals
included (e4m3's subnormals land on float16's); its conversion to float32 is exact and needs
no FP8 conversion instruction (sm_80 and gfx90a have none). The 2**8 goes into the scale
(exact), so each weight is ``value * scale`` rounded once in float32: the reference's weight bit
for bit. The two NaN codes (0x7F, 0xFF), which no checkpoint's weights hold, read as +-480 (the
CPU kernel reads them the same way).

`fp8_matmul` is the split-K GEMV of quant_gemm.py's protocol (``launch_weight_only``): a program
a tile of 64 outputs x up to 8 rows x one K split, 64 inputs a step, one scale column a step (a
step never straddles a scale block: the launcher keeps 64 or 32 inputs a step a divisor of
`scale_cols`). `fp8_dequantize` writes the weight out in the activations' dtype, rounded once
from the float32 weight (the ReferenceKernel's weight), for dequant_linear's larger products.
Written for NVIDIA, AMD and Intel Triton and the CPU interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omniinfer.kernels.triton.quant_gemm import (
    GEMV_MAX_M,
    INTERPRETED,
    bf16_round,
    gemv_accumulate,
    gemv_rows,
    gemv_zeros,
    launch_weight_only,
    matrix_rows,
    program_tile,
    split_k,
    store_out,
)

E4M3_UNIT = tl.constexpr(256.0)  # 2**8: what the float16 reading of a code leaves out (folded into the scale)


@triton.jit
def e4m3_values(codes):
    """float32 values of e4m3 codes (uint8, any shape) times 2**-8, exact (module docstring)."""
    c = codes.to(tl.int32)
    half = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    return half.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, q_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split, stride_xm, stride_om, stride_os, stride_qn, stride_sn, scale_cols,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr, ROUND_BF16: tl.constexpr, EVEN: tl.constexpr,
):
    """launch_weight_only's protocol: one program a tile of rows x outputs x one K split, the
    weight tile [BLOCK_N, BLOCK_K] (K contiguous, as the codes lie) decoded in registers and
    multiplied by each row (gemv_accumulate, K along axis 1). EVEN: N a multiple of BLOCK_N and
    every split a multiple of BLOCK_K, so no weight load is masked. (DOT_F32 is the protocol's;
    a GEMV has no dot.)"""
    pid_m, split, rows, n, k_start, k_end = program_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    rows_ok = rows < M
    n_ok = n < N
    q_rows = q_ptr + n.to(tl.int64)[:, None] * stride_qn  # [BLOCK_N, 1]
    s_rows = scale_ptr + n.to(tl.int64) * stride_sn  # [BLOCK_N]
    acc = gemv_zeros(BLOCK_M, BLOCK_N, BLOCK_K, 1)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_end
        if EVEN:
            codes = tl.load(q_rows + k[None, :])
            scale = tl.load(s_rows + k0 // scale_cols)
        else:
            codes = tl.load(q_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
            scale = tl.load(s_rows + k0 // scale_cols, mask=n_ok, other=0.0)
        w = e4m3_values(codes) * (scale * E4M3_UNIT)[:, None]  # [BLOCK_N, BLOCK_K]
        acc = gemv_accumulate(acc, w, x_ptr, k, k_ok, pid_m, M, stride_xm, BLOCK_M, 1)
    store_out(gemv_rows(acc, BLOCK_M, 1), bias_ptr, out_ptr, rows, rows_ok, n, n_ok, split,
              stride_om, stride_os, HAS_BIAS, ROUND_BF16)


@triton.jit
def _fp8_dequantize_kernel(q_ptr, scale_ptr, out_ptr, N, K, n_start, stride_qn, stride_sn,
                           stride_on, scale_cols, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           ROUND_BF16: tl.constexpr):
    """Outputs [n_start, N) of W in out's dtype ([N - n_start, K], row stride stride_on), a
    BLOCK_N x BLOCK_K tile a program (BLOCK_K a divisor of scale_cols, or K <= scale_cols)."""
    n = n_start + tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    n_ok = n < N
    ok = n_ok[:, None] & (k < K)[None, :]
    codes = tl.load(q_ptr + n.to(tl.int64)[:, None] * stride_qn + k[None, :], mask=ok, other=0)
    scale = tl.load(scale_ptr + n.to(tl.int64) * stride_sn + k0 // scale_cols, mask=n_ok, other=0.0)
    w = e4m3_values(codes) * (scale * E4M3_UNIT)[:, None]
    if ROUND_BF16:
        w = bf16_round(w)
    tl.store(out_ptr + (n - n_start).to(tl.int64)[:, None] * stride_on + k[None, :],
             w.to(out_ptr.dtype.element_ty), mask=ok)


# ---- launchers -----------------------------------------------------------------------------
def check_fp8_weight(q: torch.Tensor, scale: torch.Tensor, k: int, scale_cols: int) -> int:
    """Checks the piece's tensors for K = `k`; returns the inputs a step (64 or 32, a divisor of
    `scale_cols`, or 64 where one scale covers every input)."""
    if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] != k or q.stride(1) != 1:
        raise ValueError(f"q must be uint8 [N, {k}] with contiguous rows (e4m3 codes), got "
                         f"{q.dtype} {tuple(q.shape)} strides {q.stride()}")
    if scale_cols <= 0:
        raise ValueError(f"scale_cols must be positive, got {scale_cols}")
    blocks = triton.cdiv(k, scale_cols)
    if (scale.dtype != torch.float32 or scale.dim() != 2 or tuple(scale.shape) != (q.shape[0], blocks)
            or scale.stride(1) != 1):
        raise ValueError(f"scale must be float32 [{q.shape[0]}, {blocks}] (a scale per row and "
                         f"block of {scale_cols} inputs) with contiguous rows, got {scale.dtype} "
                         f"{tuple(scale.shape)}")
    if scale_cols >= k or scale_cols % 64 == 0:
        return 64
    if scale_cols % 32 == 0:
        return 32
    raise ValueError(f"scale_cols={scale_cols}: the kernels take scale blocks of a multiple of 32 "
                     f"inputs, or one block for all {k}")


def fp8_tiles(m: int, n: int, k: int, block_k: int, block_n: int = 64, programs: int = 512) -> dict:
    """`fp8_matmul`'s launch configuration for an [m, k] x [k, n] product: up to GEMV_MAX_M rows
    a program, `block_n` outputs, K split until about `programs` run (wn_tiles' GEMV choice;
    not yet timed on a GPU: scripts/gpu_check.sh times it)."""
    block_m = min(GEMV_MAX_M, triton.next_power_of_2(max(1, m)))
    split, k_per_split = split_k(triton.cdiv(n, block_n) * triton.cdiv(m, block_m), k, block_k, programs)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, split_k=split,
                k_per_split=k_per_split, num_warps=4)


def fp8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scale_cols: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x [..., K] (float16/bfloat16/float32) and W [N, K] as e4m3 codes
    `q` and float32 scales `scale` [N, ceil(K / scale_cols)]: float32 sums of x times the
    float32 weight (the split-K GEMV, any number of rows, GEMV_MAX_M a program). Returns
    [..., N] in x's dtype."""
    x2 = matrix_rows(x)
    m, k = x2.shape
    n = q.shape[0]
    block_k = check_fp8_weight(q, scale, k, scale_cols)
    if m == 0:
        return x.new_empty(*x.shape[:-1], n)
    cfg = fp8_tiles(m, n, k, block_k)
    even = n % cfg["BLOCK_N"] == 0 and cfg["k_per_split"] % block_k == 0 and k % block_k == 0
    return launch_weight_only(_fp8_matmul_kernel, x, x2, (q, scale),
                              (q.stride(0), scale.stride(0), scale_cols), n, cfg, bias, EVEN=even)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, scale_cols: int, dtype: torch.dtype,
                   n_start: int = 0, n_end: int | None = None, block_n: int = 32) -> torch.Tensor:
    """Outputs [n_start, n_end) of W as [n_end - n_start, K] in `dtype`: ``e4m3(q) * scale`` in
    float32 rounded once to `dtype` (the ReferenceKernel's weight, bit for bit)."""
    block_k = check_fp8_weight(q, scale, q.shape[-1], scale_cols)
    n, k = q.shape
    n_end = n if n_end is None else n_end
    if not 0 <= n_start <= n_end <= n:
        raise ValueError(f"outputs [{n_start}, {n_end}) are not within the weight's {n}")
    out = torch.empty(n_end - n_start, k, dtype=dtype, device=q.device)
    if k and n_end > n_start:
        block_k = 4 * block_k if (scale_cols >= k or scale_cols % (4 * block_k) == 0) else block_k
        grid = (triton.cdiv(n_end - n_start, block_n), triton.cdiv(k, block_k))
        _fp8_dequantize_kernel[grid](q, scale, out, n_end, k, n_start, q.stride(0), scale.stride(0),
                                     out.stride(0), scale_cols, BLOCK_N=block_n, BLOCK_K=block_k,
                                     ROUND_BF16=INTERPRETED and dtype == torch.bfloat16, num_warps=4)
    return out
