"""Quantized linear layers as the layers run them: a fused kernel for a few rows, the weight
dequantised then torch's matmul for more.

A fused kernel (gguf_gemm.py, quant_gemm.py, int8_gemm.py, fp8_gemm.py) decodes every weight in registers
for each tile of rows; past a few rows that decode, repeated per row tile and done on the cores
that should be multiplying, costs more than writing the weight out once in the activation dtype
and handing it to the vendor's GEMM (cuBLAS, hipBLASLt, oneDNN), which runs at the device's
peak. Measured on an H200 (benchmarks/gguf_tiles.py, scripts/gpu_check.sh;
docs/quantization.md): Llama-3-8B's gate_up as Q4_K at 512 rows, fused 1,481 us, dequantised +
F.linear 322 us, dense bf16 F.linear 161 us; at 1 row the fused GEMV wins (163 us against 208).

``gguf_linear``, ``wn_linear``, ``int8_linear`` (weight-only int8) and ``fp8_linear`` pick between them by the
rows (the bounds below). The
dequantised weight is transient: at most ``DEQUANT_WORKSPACE_BYTES`` live at a time (wider
layers go in output chunks; each chunk is two more launches, whose host time showed on the
H200 with 64 MiB chunks, so 256 MiB holds a Llama-3-8B layer's bfloat16 weight whole). A layer
never holds a float copy of its weight; a CUDA graph's pool reuses the workspace from layer to
layer. The accelerators' KV-cache budget keeps room for it (platforms/interface.py,
`dequant_workspace_bytes`). Numerics: the reference's, the weight rounded once to x's dtype and
multiplied by torch's matmul (float32 sums); only the order of the sums differs from the fused
kernels'.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from omniinfer.kernels.triton.fp8_gemm import check_fp8_weight, fp8_dequantize, fp8_matmul
from omniinfer.kernels.triton.gguf_gemm import gguf_dequantize, gguf_matmul
from omniinfer.kernels.triton.int8_gemm import check_int8_weight, int8_matmul
from omniinfer.kernels.triton.quant_gemm import (
    INTERPRETED,
    bf16_round,
    check_qweight,
    matrix_rows,
    wn_matmul,
    wn_tile,
    wn_tiles,
)
from omniinfer.quantization.base import DEQUANT_WORKSPACE_BYTES  # noqa: F401 (read at each call: tests patch it here)

# Rows up to which the fused kernels run (more: dequantise, then torch's matmul), from an H200
# (bfloat16, Llama-3-8B's gate_up and down; benchmarks/gguf_tiles.py and quant_kernels.py --path,
# 2026-12-04): the GGUF GEMV won at 1-4 rows in every case and lost at 8 (Q8_0's tl.dot tiles
# won at 8 too: 72-124 us against 115-216); the n-bit GEMV won at 1 row on gate_up only (129 us
# against ~165) and lost from 1 row with act-order g_idx (its gathered scales: 254 against ~170).
GGUF_FUSED_MAX_M = 4
GGUF_FUSED_MAX_M_OF = {"Q8_0": 8}
WN_FUSED_MAX_M = 1
WN_G_IDX_FUSED_MAX_M = 0
# int8 weight-only (W8A16): int8_matmul's tl.dot tiles ran gate_up at the dense product's speed
# at 1-8 rows (H200: 57-60 us against 57-62) and at 0.39x at 512 rows (414 against 161), reading
# the weight once per 64 rows. Not measured between, nor the int8 route itself: this bound is
# where the tiles, at that rate (~52 us a pass of gate_up), pass the dequantised route's cost
# estimated from Q8_0's (dequantise ~140 us, then the dense product). The tiles' grid now runs
# the rows' tiles together (quant_gemm.program_tile), which may move the crossover up: gpu_check
# times both at 64-512 rows. W8A8 keeps its int8 product.
INT8_FUSED_MAX_M = 128
# FP8 weight-only: the GEMV up to GGUF's bound (its decode, a few integer ops and a float16
# conversion a weight, is cheaper than any GGUF type's; not yet timed on a GPU: gpu_check times
# both paths)
FP8_FUSED_MAX_M = 4


def gguf_fused_max_m(type_name: str) -> int:
    return GGUF_FUSED_MAX_M_OF.get(type_name, GGUF_FUSED_MAX_M)


def wn_fused_max_m(has_g_idx: bool) -> int:
    return WN_G_IDX_FUSED_MAX_M if has_g_idx else WN_FUSED_MAX_M


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, type_name: str,
                bias: torch.Tensor | None = None, fused_max_m: int | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for W held as GGUF blocks (gguf_gemm.gguf_matmul's arguments):
    `gguf_matmul` for up to `fused_max_m` rows (default: gguf_fused_max_m), else W dequantised
    (gguf_dequantize) in chunks of outputs and multiplied by torch."""
    x2 = matrix_rows(x)
    if x2.shape[0] <= (gguf_fused_max_m(type_name) if fused_max_m is None else fused_max_m):
        return gguf_matmul(x, blocks, type_name, bias)
    k = x2.shape[1]
    return _dequantized_product(
        x, x2, blocks.shape[0], bias,
        lambda n0, n1: gguf_dequantize(blocks[n0:n1], type_name, k, x.dtype), n_major=True)


def wn_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor | None, g_idx: torch.Tensor | None, bits: int, group_size: int,
              bias: torch.Tensor | None = None, fused_max_m: int | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for an n-bit weight (quant_gemm.wn_matmul's arguments): `wn_matmul`
    for up to `fused_max_m` rows (default: wn_fused_max_m), else W dequantised (wn_dequantize)
    in chunks of outputs and multiplied by torch."""
    x2 = matrix_rows(x)
    if x2.shape[0] <= (wn_fused_max_m(g_idx is not None) if fused_max_m is None else fused_max_m):
        return wn_matmul(x, qweight, scales, zeros, g_idx, bits, group_size, bias)
    check_qweight(qweight, x2.shape[1], bits)
    return _dequantized_product(
        x, x2, qweight.shape[1], bias,
        lambda n0, n1: wn_dequantize(qweight, scales, zeros, g_idx, bits, group_size,
                                     x2.shape[1], x.dtype, n0, n1), n_major=False)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                input_scale: torch.Tensor | None = None, quantize_activations: bool = True,
                bias: torch.Tensor | None = None, fused_max_m: int | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale[:, None]).T (+ bias)`` (int8_gemm.int8_matmul's arguments):
    `int8_matmul` for W8A8 and for W8A16 up to `fused_max_m` rows (default INT8_FUSED_MAX_M),
    else the W8A16 weight dequantised (int8_dequantize) in chunks of outputs and multiplied by
    torch."""
    x2 = matrix_rows(x)
    if quantize_activations or x2.shape[0] <= (INT8_FUSED_MAX_M if fused_max_m is None else fused_max_m):
        return int8_matmul(x, weight, weight_scale, input_scale, quantize_activations, bias)
    check_int8_weight(weight, x2.shape[1])
    return _dequantized_product(
        x, x2, weight.shape[0], bias,
        lambda n0, n1: int8_dequantize(weight[n0:n1], weight_scale[n0:n1], x.dtype), n_major=True)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, scale_cols: int,
               bias: torch.Tensor | None = None, fused_max_m: int | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for an FP8 weight (fp8_gemm.fp8_matmul's arguments): `fp8_matmul`
    for up to `fused_max_m` rows (default FP8_FUSED_MAX_M), else W dequantised (fp8_dequantize)
    in chunks of outputs and multiplied by torch."""
    x2 = matrix_rows(x)
    if x2.shape[0] <= (FP8_FUSED_MAX_M if fused_max_m is None else fused_max_m):
        return fp8_matmul(x, q, scale, scale_cols, bias)
    check_fp8_weight(q, scale, x2.shape[1], scale_cols)
    return _dequantized_product(
        x, x2, q.shape[0], bias,
        lambda n0, n1: fp8_dequantize(q, scale, scale_cols, x.dtype, n0, n1), n_major=True)


def _dequantized_product(x: torch.Tensor, x2: torch.Tensor, n: int, bias: torch.Tensor | None,
                         weight: Callable[[int, int], torch.Tensor], n_major: bool) -> torch.Tensor:
    """x2 @ W.T (+ bias) shaped as x's rows by n, W's outputs [n0, n1) at a time from
    `weight(n0, n1)`: [n1 - n0, K] (`n_major`) or [K, n1 - n0], in x's dtype."""
    m, k = x2.shape
    step = max(64, DEQUANT_WORKSPACE_BYTES // max(1, k * x.element_size()) // 64 * 64)
    parts = []
    for n0 in range(0, n, step):
        n1 = min(n, n0 + step)
        w = weight(n0, n1)
        b = None if bias is None else bias[n0:n1]
        if n_major:
            parts.append(torch.nn.functional.linear(x2, w, b))
        else:
            parts.append(torch.mm(x2, w) if b is None else torch.addmm(b, x2, w))
        del w  # the next chunk reuses its memory
    out = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    return out.view(*x.shape[:-1], n)


@triton.jit
def _wn_dequantize_kernel(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, N, K, n_start,
                          n_end, stride_ok, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,
                          TILE_IN_ONE_GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                          HAS_G_IDX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          ROUND_BF16: tl.constexpr):
    """W^T's inputs x outputs [n_start, n_end) in out's dtype ([K, n_end - n_start], row stride
    stride_ok): the fused kernel's tile decode (quant_gemm.wn_tile), stored."""
    k0 = tl.program_id(0) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < K
    n = n_start + tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_end
    w = wn_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, N, k0, k, k_ok, n, n_ok, BITS,
                GROUP_SIZE, TILE_IN_ONE_GROUP, HAS_ZEROS, HAS_G_IDX)
    if ROUND_BF16:
        w = bf16_round(w)
    tl.store(out_ptr + k.to(tl.int64)[:, None] * stride_ok + (n - n_start)[None, :],
             w.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


def wn_dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                  g_idx: torch.Tensor | None, bits: int, group_size: int, k: int,
                  dtype: torch.dtype, n_start: int = 0, n_end: int | None = None) -> torch.Tensor:
    """W^T [K, n_end - n_start] in `dtype` (outputs n_start..n_end of an n-bit weight in
    wn_matmul's layout): ``(code - zero) * scale`` in float32 rounded once to `dtype`, as the
    reference (quantization/int_reference.py) rounds it."""
    n = qweight.shape[1]
    n_end = n if n_end is None else n_end
    if not 0 <= n_start <= n_end <= n:
        raise ValueError(f"outputs [{n_start}, {n_end}) are not within the weight's {n}")
    out = torch.empty(k, n_end - n_start, dtype=dtype, device=qweight.device)
    # the GEMV's tile along K (one group's scales a tile where groups allow), 64 outputs wide
    tile = wn_tiles(1, n, k, group_size, g_idx is not None, bits)
    block_k, block_n = tile["BLOCK_K"], 64
    if k and n_end > n_start:
        grid = (triton.cdiv(k, block_k), triton.cdiv(n_end - n_start, block_n))
        _wn_dequantize_kernel[grid](
            qweight, scales, scales if zeros is None else zeros,
            qweight if g_idx is None else g_idx, out, n, k, n_start, n_end, out.stride(0),
            BITS=bits, GROUP_SIZE=tile["GROUP_SIZE"], TILE_IN_ONE_GROUP=tile["TILE_IN_ONE_GROUP"],
            HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None, BLOCK_K=block_k,
            BLOCK_N=block_n, ROUND_BF16=INTERPRETED and dtype == torch.bfloat16, num_warps=4)
    return out


@triton.jit
def _int8_dequantize_kernel(w_ptr, scale_ptr, out_ptr, N, K, stride_wn, stride_on,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROUND_BF16: tl.constexpr):
    """W [N, K] in out's dtype, a BLOCK_N x BLOCK_K tile a program: ``code * scale[n]``."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (n < N)[:, None] & (k < K)[None, :]
    codes = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :], mask=ok, other=0)
    w = codes.to(tl.float32) * tl.load(scale_ptr + n, mask=n < N, other=0.0)[:, None]
    if ROUND_BF16:
        w = bf16_round(w)
    tl.store(out_ptr + n.to(tl.int64)[:, None] * stride_on + k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=ok)


def int8_dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype,
                    block_n: int = 32, block_k: int = 256) -> torch.Tensor:
    """W [N, K] in `dtype` from int8 codes [N, K] (contiguous rows) and float32 scales [N]:
    ``code * scale`` in float32 rounded once to `dtype` (the ReferenceKernel's weight)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be int8 [N, K], got {tuple(weight.shape)}")
    n, k = weight.shape
    check_int8_weight(weight, k)
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (n,):
        raise ValueError(f"weight_scale must be float32 [{n}], got {weight_scale.dtype} "
                         f"{tuple(weight_scale.shape)}")
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    if n and k:
        _int8_dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
            weight, weight_scale, out, n, k, weight.stride(0), out.stride(0), BLOCK_N=block_n,
            BLOCK_K=block_k, ROUND_BF16=INTERPRETED and dtype == torch.bfloat16, num_warps=4)
    return out
