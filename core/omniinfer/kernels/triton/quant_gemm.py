"""Quantized linear layers in Triton: n-bit weight-only (GPTQ / AWQ / compressed-tensors), and
the tile helpers every quantized product here shares (int8_gemm.py, gguf_gemm.py).

Weight-only (``wn_matmul``): weights in the layout of
:class:`omniinfer.quantization.int_layouts.PackedIntWeight` (GPTQ's): int32 words packed
along the input dim K, ``32 // BITS`` codes a word, the output dim N contiguous; scales and
optional zero points [groups, N]; optional ``g_idx`` [K] (act-order). A tile of ``BLOCK_K``
inputs x ``BLOCK_N`` outputs is dequantized in registers, ``(code - zero) * scale`` in
float32, rounded to the activation dtype (the reference rounds its float weight the same
way), and multiplied with fp32 accumulation:

* prefill-sized M (``wn_gemm``): ``tl.dot`` tiles of BLOCK_M rows;
* decode, M = 1-8 (``wn_gemv``): no dot (M would be padded to 16); each row's products are
  summed over the tile, and K is split over ``SPLIT_K`` programs whose float32 partial sums
  land in a workspace that one torch sum reduces (deterministic, unlike atomics), so that a
  decode's few outputs still spread over every compute unit.

Written for NVIDIA, AMD and Intel Triton and the CPU interpreter: plain masked loads,
``tl.dot`` on tiles of at least 16, no vendor intrinsics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omniinfer.kernels.triton.wn_gemv import input_groups, tile_group, wn_gemv

INTERPRETED = bool(triton.knobs.runtime.interpret)  # fixed when the kernels below are defined
# Triton's interpreter (3.9) multiplies bfloat16 operands of tl.dot as their raw uint16 storage
# and converts float32 to bfloat16 by truncation: interpreted kernels do their dots in float32
# and round to bfloat16 themselves (ROUND_BF16: to nearest even, in float32 bits), so they
# compute what a GPU computes.
GEMV_MAX_M = 8


@triton.jit
def _wn_matmul_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split, stride_xm, stride_om, stride_os,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, TILE_IN_ONE_GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, ROUND_BF16: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_m, split, rows, n, k_start, k_end = program_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    rows_ok = rows < M
    n_ok = n < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_end
            w = wn_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, N, k0, k, k_ok, n, n_ok,
                        BITS, GROUP_SIZE, TILE_IN_ONE_GROUP, HAS_ZEROS, HAS_G_IDX)
            acc = accumulate(acc, w, x_rows, rows_ok, k, k_ok, DOT_F32, ROUND_BF16)
    else:
        acc = wn_gemv(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, M, N, K, pid_m,
                       stride_xm, n, n_ok, k_start, k_end, BITS, GROUP_SIZE, TILE_IN_ONE_GROUP,
                       HAS_ZEROS, HAS_G_IDX, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    store_out(acc, bias_ptr, out_ptr, rows, rows_ok, n, n_ok, split, stride_om, stride_os,
              HAS_BIAS, ROUND_BF16)


@triton.jit
def wn_tile(qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, N, k0, k, k_ok, n, n_ok,
            BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, TILE_IN_ONE_GROUP: tl.constexpr,
            HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr):
    """The weights of inputs k [BLOCK_K] (from k0) x outputs n [BLOCK_N], ``(code - zero) *
    scale`` in float32 [BLOCK_K, BLOCK_N] (masked codes read as 0)."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    MIDPOINT: tl.constexpr = 1 << (BITS - 1)
    # every code of a word is read from the same word: PACK rows share one load
    words = tl.load(qweight_ptr + (k // PACK).to(tl.int64)[:, None] * N + n[None, :],
                    mask=k_ok[:, None] & n_ok[None, :], other=0)
    codes = ((words >> ((k % PACK) * BITS)[:, None]) & MASK)  # int32, 0 <= code < 2**BITS
    if TILE_IN_ONE_GROUP:  # one row of scales (and zeros) serves the whole tile
        scale, zero = tile_group(scales_ptr, zeros_ptr, N, k0, n, n_ok, GROUP_SIZE, HAS_ZEROS,
                                 0.0)
    else:
        scale, zero = input_groups(scales_ptr, zeros_ptr, g_idx_ptr, N, k, k_ok, n, n_ok,
                                   GROUP_SIZE, HAS_ZEROS, HAS_G_IDX, MIDPOINT)
    if HAS_ZEROS:
        return (exact_float(codes, 0) - zero) * scale
    return exact_float(codes, MIDPOINT) * scale


@triton.jit
def exact_float(q, offset: tl.constexpr):
    """`q - offset` in float32 for int32 0 <= q < 2**23: the bits of 2**23 + q (an OR), less
    2**23 + offset (one exact add), instead of a conversion (NVIDIA's int-to-float conversions
    issue at a fraction of the rate of integer and float arithmetic)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def program_tile(M, N, K, k_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A weight-only program's part of the grid (M tiles, N tiles, K splits): its M tile's index,
    its split, its rows and outputs, and the inputs [k_start, k_end) it sums. The M tiles are
    the grid's fastest dimension, so the programs that read one tile of the weight run
    together and all but the first can find it in the cache. (With the N tiles fastest, a GPU
    runs one M tile's programs across the whole weight before the next M tile's: a weight larger
    than the cache is read from memory once per M tile, 8 times at 512 rows. Reasoned from the
    H200's 512-row int8 times, 0.39-0.50x dense; not yet measured since.)"""
    pid_m = tl.program_id(0)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_per_split
    return pid_m, split, rows, n, k_start, tl.minimum(K, k_start + k_per_split)


@triton.jit
def bf16_round(v):
    """float32 `v` rounded to the nearest bfloat16 (ties to even), still float32."""
    bits = v.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def accumulate(acc, w, x_rows, rows_ok, k, k_ok, DOT_F32: tl.constexpr, ROUND_BF16: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + x[rows, k] @ w for a float32 weight tile w [BLOCK_K, BLOCK_N]
    rounded first to x's dtype (the reference rounds its float weight the same way), as a
    tl.dot (the GEMV's products are gemv_accumulate's)."""
    if ROUND_BF16:
        w = bf16_round(w)
    else:
        w = w.to(x_rows.dtype.element_ty)
    x = tl.load(x_rows + k[None, :], mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
    if DOT_F32:
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(x, w, input_precision="ieee")
    return acc


@triton.jit
def gemv_zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               K_AXIS: tl.constexpr):
    """The GEMV's float32 sums: one row's products kept per weight position (w's shape, K
    along K_AXIS), summed once at the end; several rows' [BLOCK_M, BLOCK_N], summed per tile."""
    if BLOCK_M == 1:
        if K_AXIS == 0:
            acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    return acc


@triton.jit
def gemv_accumulate(acc, w, x_ptr, k, k_ok, pid_m, M, stride_xm, BLOCK_M: tl.constexpr,
                    K_AXIS: tl.constexpr):
    """The GEMV (1-8 rows, no tl.dot: it would pad M to 16): acc + each row's x[row, k] times
    the float32 weight tile w (K along K_AXIS), in float32. The weight is not rounded to x's
    dtype (a conversion a weight; the sums are then closer to float32 than the reference's)."""
    for m in tl.static_range(BLOCK_M):
        row = pid_m * BLOCK_M + m
        x_m = tl.load(x_ptr + row.to(tl.int64) * stride_xm + k,
                      mask=k_ok & (k * 0 + row < M), other=0.0).to(tl.float32)
        if K_AXIS == 0:
            products = x_m[:, None] * w
        else:
            products = x_m[None, :] * w
        if BLOCK_M == 1:
            acc += products
        else:
            part = tl.sum(products, K_AXIS)  # [BLOCK_N]
            acc += tl.where(tl.arange(0, BLOCK_M)[:, None] == m, part[None, :], 0.0)
    return acc


@triton.jit
def gemv_rows(acc, BLOCK_M: tl.constexpr, K_AXIS: tl.constexpr):
    """gemv_zeros' sums as [BLOCK_M, BLOCK_N]."""
    if BLOCK_M == 1:
        acc = tl.sum(acc, K_AXIS)[None, :]
    return acc


@triton.jit
def store_out(acc, bias_ptr, out_ptr, rows, rows_ok, n, n_ok, split, stride_om, stride_os,
              HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """acc (+ bias) stored in out's dtype at split `split`'s rows (stride_os 0: no split)."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16 and out_ptr.dtype.element_ty != tl.float32:  # the store's truncation is then
        acc = bf16_round(acc)  # exact (a split's float32 partial sums are kept whole)
    out = out_ptr + split.to(tl.int64) * stride_os + rows.to(tl.int64)[:, None] * stride_om
    tl.store(out + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rows_ok[:, None] & n_ok[None, :])


# ---- launchers -----------------------------------------------------------------------------
def matrix_rows(x: torch.Tensor, what: str = "x") -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        raise ValueError(f"{what} must have a contiguous last dimension, got strides {x.stride()}")
    return x2


def wn_tiles(m: int, n: int, k: int, group_size: int, has_g_idx: bool, bits: int,
             element_size: int = 2, block_n: int = 64, programs: int = 512,
             num_warps: int = 4) -> dict:
    """The launch configuration `wn_matmul` uses for an [m, k] x [k, n] product of activations
    of `element_size` bytes: tiles, split, warps; a function of the shapes alone, so the
    catalogue can list it. `block_n`, `programs` (K is split until about that many run) and
    `num_warps` shape the GEMV (benchmarks/gguf_tiles.py tries others)."""
    # float32 dots are FMAs on register tiles: a 64x64x64 tile on 4 warps spills on NVIDIA
    # (ptxas: 7-8 KB), and so do 32 rows with a 64-deep K tile; 32 x 64 x 32 on 8 warps does
    # not (python -m omniinfer.testing.kernels_aot). The interpreter, whose cost is per
    # program, keeps the bigger tile.
    wide = element_size == 4 and not INTERPRETED and m > GEMV_MAX_M
    # a K tile inside one group when groups are contiguous: one row of scales per tile
    block_k = 32 if group_size == 32 or wide else 64
    group = 0 if group_size <= 0 or group_size >= k else group_size
    one_group = not has_g_idx and (group == 0 or group % block_k == 0)
    if m <= GEMV_MAX_M:
        block_m = triton.next_power_of_2(m)
        n_tiles = triton.cdiv(n, block_n)
        # enough programs to cover a large GPU several times over (~512), each >= 2 K tiles
        split, k_per_split = split_k(n_tiles, k, block_k, programs)
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, split_k=split,
                    k_per_split=k_per_split, USE_DOT=False, GROUP_SIZE=group,
                    TILE_IN_ONE_GROUP=one_group, num_warps=num_warps)
    block_m = min(32 if wide else 64, max(16, triton.next_power_of_2(m)))
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, split_k=1,
                k_per_split=triton.cdiv(k, block_k) * block_k, USE_DOT=True, GROUP_SIZE=group,
                TILE_IN_ONE_GROUP=one_group, num_warps=8 if wide else 4)


def wn_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor | None, g_idx: torch.Tensor | None, bits: int,
              group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x [..., K] (float16/bfloat16/float32) and W [N, K] held as a
    PackedIntWeight's tensors (qweight int32 [ceil(K / (32 / bits)), N], scales and zeros
    [groups, N], g_idx int32 [K] or None; `group_size` inputs per group). Rows 1-8 take the
    split-K GEMV, more the tiled GEMM. Returns [..., N] in x's dtype."""
    x2 = matrix_rows(x)
    m, k = x2.shape
    n = qweight.shape[1]
    check_qweight(qweight, k, bits)
    cfg = wn_tiles(m, n, k, group_size, g_idx is not None, bits, x.element_size())
    weights = (qweight, scales, scales if zeros is None else zeros,
               qweight if g_idx is None else g_idx)
    return launch_weight_only(_wn_matmul_kernel, x, x2, weights, (), n, cfg, bias, BITS=bits,
                              HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None,
                              EVEN_K=k % cfg["BLOCK_K"] == 0)


def check_qweight(qweight: torch.Tensor, k: int, bits: int) -> None:
    if qweight.dtype != torch.int32 or qweight.shape[0] != triton.cdiv(k, 32 // bits):
        raise ValueError(f"qweight must be int32 [{triton.cdiv(k, 32 // bits)}, N] for K={k} at "
                         f"{bits} bits, got {qweight.dtype} {tuple(qweight.shape)}")


def launch_weight_only(kernel, x: torch.Tensor, x2: torch.Tensor, weights: tuple,
                       scalars: tuple, n: int, cfg: dict, bias: torch.Tensor | None,
                       **constexprs) -> torch.Tensor:
    """Runs a weight-only kernel whose parameters are ``(x, *weights, bias, out, M, N, K,
    k_per_split, stride_xm, stride_om, stride_os, *scalars)`` and the constexprs HAS_BIAS,
    DOT_F32, ROUND_BF16 and `cfg`'s tiles: with K split, into float32 partial sums [split, M,
    N] that one torch sum reduces (deterministic), the bias added and the result rounded once."""
    m, k = x2.shape
    out_shape = (*x.shape[:-1], n)
    if m == 0:
        return x.new_empty(out_shape)
    cfg = dict(cfg)
    split = cfg.pop("split_k")
    k_per_split = cfg.pop("k_per_split")
    out = (torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1
           else torch.empty(m, n, dtype=x.dtype, device=x.device))
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    has_bias = bias is not None and split == 1
    kernel[grid](x2, *weights, bias if has_bias else x2, out, m, n, k, k_per_split, x2.stride(0),
                 out.stride(-2), out.stride(0) if split > 1 else 0, *scalars,
                 HAS_BIAS=has_bias, DOT_F32=INTERPRETED,
                 ROUND_BF16=INTERPRETED and x.dtype == torch.bfloat16, **cfg, **constexprs)
    if split > 1:  # the partial sums, reduced in float32 and rounded once
        total = out.sum(0)
        out = (total if bias is None else total + bias.float()).to(x.dtype)
    return out.view(out_shape)


def split_k(tiles: int, k: int, block_k: int, programs: int) -> tuple[int, int]:
    """(splits, inputs per split): K split in a power of two until about `programs` run beside
    `tiles` output tiles, each split at least 2 K tiles."""
    k_tiles = triton.cdiv(k, block_k)
    split = max(1, min(programs // tiles, k_tiles // 2))
    split = 1 << (split.bit_length() - 1)
    k_per_split = triton.cdiv(k_tiles, split) * block_k
    return triton.cdiv(k, k_per_split), k_per_split
