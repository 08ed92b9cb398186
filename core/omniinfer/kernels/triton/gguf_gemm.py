"""GGUF-quantised linear layers in Triton: ``x @ W.T`` with W held as the file's own blocks.

The weight is what the GGUF file stores and the loader keeps (quantization/gguf_file.py): uint8
[N, K / B * block_bytes], one row of blocks per output. Nothing is repacked: a tile of
``BLOCK_N`` outputs x 32 inputs (one 32-weight run of each output's block: a classic block, or
a K-quant sub-block) reads what the run shares (d, the minimum, the sub-block's scale) once an
output and the codes once a weight, from the blocks' bytes (k contiguous in a row), and decodes
them in registers, in float32 and in the order
``gguf.quants.dequantize`` (and quantization/gguf_blocks.py) computes them, for every block type
the loader takes: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS
(the IQ4 codes index a 16-entry table the launcher keeps on the device). The decoded tile then goes
through the weight-only products of quant_gemm.py (rounded once to the activation dtype; the
split-K GEMV for 1-8 rows, tl.dot tiles for more), so the numerics are theirs: the reference
dequantised to x's dtype and multiplied with float32 sums, up to the order of the sums (and, on
a GPU that contracts ``d * q + m`` to one FMA, the last bit of a Q4_1/Q5_1/K-quant weight).
One row of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL runs gguf_gemv.py's GEMV, of Q2_K to Q6_K
and IQ4_XS gguf_kgemv.py's (``ONE_ROW``): wider loads, codes made floats in place (the IQ4
types' table entry computed from the code), scales applied once a block or sub-block to sums
of ``x * code``.

Written for NVIDIA, AMD and Intel Triton and the CPU interpreter: byte loads, shifts and masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omniinfer.kernels.triton.gguf_gemv import CLASSIC_GEMV_TYPES, classic_gemv, classic_gemv_even
from omniinfer.kernels.triton.gguf_kgemv import (
    iq4xs_gemv,
    kquant_gemv,
    q2k_gemv,
    q3k_gemv,
    q6k_gemv,
)
from omniinfer.kernels.triton.quant_gemm import (  # noqa: F401 (INTERPRETED: read by the package)
    GEMV_MAX_M,
    INTERPRETED,
    accumulate,
    bf16_round,
    exact_float,
    gemv_accumulate,
    gemv_rows,
    gemv_zeros,
    launch_weight_only,
    matrix_rows,
    program_tile,
    split_k,
    store_out,
    wn_tiles,
)
from omniinfer.quantization.gguf_blocks import BY_NAME, QUANTIZED, iq4_table
from omniinfer.quantization.gguf_iq import LATTICE

# the block types the kernel decodes (its TYPE is the GGML type code): every one the loader takes
# but the lattice types (quantization/triton_kernel.py rewrites those first, gguf_transcode.py)
KERNEL_TYPES = tuple(t for t in QUANTIZED if t not in LATTICE)
CLASSIC_UNROLL = 2  # blocks a step of the classic types' one-row GEMV (gguf_gemv.py)
# the types gguf_kgemv.py's one-row GEMVs take, with the alignment their loads need
KQUANT_GEMV = {"Q4_K": 4, "Q5_K": 4, "Q6_K": 2, "Q3_K": 2, "Q2_K": 4, "IQ4_XS": 4}


@triton.jit
def _byte(row, off, ok):
    """The bytes at offset `off` [1, BLOCK_K] of each output's row `row` [BLOCK_N, 1], as int32
    [BLOCK_N, BLOCK_K] (the offsets are computed once per K tile, not per output)."""
    return tl.load(row + off, mask=ok, other=0).to(tl.int32)


@triton.jit
def _f16(row, off, ok):
    """The little-endian float16 at byte `off`, as float32."""
    v = (_byte(row, off, ok) | (_byte(row, off + 1, ok) << 8)).to(tl.uint16)
    return v.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(p, sub, ok):
    """Q4_K / Q5_K: sub-block `sub`'s 6-bit scale and minimum from the 12 bytes at p + 4, for
    each output [BLOCK_N, 1] (sub 0-3: the low 6 bits of bytes sub and 4 + sub; 4-7: a nibble of
    byte 8 + i and the top two bits of bytes i and 4 + i, i = sub - 4)."""
    i = sub % 4
    s0 = _byte(p, 4 + i, ok)
    s1 = _byte(p, 8 + i, ok)
    s2 = _byte(p, 12 + i, ok)
    low = sub < 4
    sc = tl.where(low, s0 & 63, (s2 & 15) | ((s0 >> 6) << 4))
    mn = tl.where(low, s1 & 63, (s2 >> 4) | ((s1 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _halves(jj, first, second):
    """Per weight of a 32-weight run (jj [1, 32]), `first` [BLOCK_N, 1] for its first 16 and
    `second` for the rest: the 16-weight scales of Q2_K, Q3_K and Q6_K, read and multiplied by d
    once an output, not once a weight."""
    return tl.where(jj < 16, first, second)


@triton.jit
def _q3_k_scale(p, i, p_ok):
    """Q3_K: 16-weight group i's scale less 32, float32 (its low 4 bits from byte 96 + i % 8,
    its top 2 from byte 104 + i % 4)."""
    sc = (_byte(p, 96 + i % 8, p_ok) >> ((i // 8) * 4)) & 15
    return exact_float(sc | (((_byte(p, 104 + i % 4, p_ok) >> ((i // 4) * 2)) & 3) << 4), 32)


@triton.jit
def _decode(p, j0, jj, ok, p_ok, lut_ptr, TYPE: tl.constexpr):
    """Weights j0 + jj of the block at `p` (each output's block, [BLOCK_N, 1] pointers), float32
    [BLOCK_N, 32]: jj is 0..31 [1, 32] and j0 a multiple of 32, so all 32 lie in one classic
    block or one 32-weight run of a K-quant block, and what they share (d, the minimum, a
    sub-block's scale) is loaded once per output ([BLOCK_N, 1], masked by p_ok), not once per
    weight; only the codes (and Q2_K / Q3_K / Q6_K's 16-weight scales) are per weight (`ok`).
    `lut_ptr`: IQ4_VALUES as float32, for the IQ4 types."""
    if TYPE == 8:  # Q8_0: d, 32 int8
        q = _byte(p, 2 + jj, ok)
        w = _f16(p, 0, p_ok) * exact_float(q ^ 128, 128)  # the int8 code: (q ^ 128) - 128
    elif TYPE == 2 or TYPE == 3:  # Q4_0: d, 16 bytes of nibbles; Q4_1: d, m, nibbles
        QS: tl.constexpr = 2 if TYPE == 2 else 4
        q = (_byte(p, QS + jj % 16, ok) >> ((jj // 16) * 4)) & 15
        if TYPE == 2:
            w = _f16(p, 0, p_ok) * exact_float(q, 8)
        else:
            w = _f16(p, 0, p_ok) * exact_float(q, 0) + _f16(p, 2, p_ok)
    elif TYPE == 6 or TYPE == 7:  # Q5_0: d, 4 bytes of fifth bits, nibbles; Q5_1: d, m, ...
        QH: tl.constexpr = 2 if TYPE == 6 else 4
        q = (_byte(p, QH + 4 + jj % 16, ok) >> ((jj // 16) * 4)) & 15
        qh = (_byte(p, QH, p_ok) | (_byte(p, QH + 1, p_ok) << 8) | (_byte(p, QH + 2, p_ok) << 16)
              | (_byte(p, QH + 3, p_ok) << 24))  # the 32 fifth bits as one word an output
        q = q | (((qh >> jj) & 1) << 4)
        if TYPE == 6:
            w = _f16(p, 0, p_ok) * exact_float(q, 16)
        else:
            w = _f16(p, 0, p_ok) * exact_float(q, 0) + _f16(p, 2, p_ok)
    elif TYPE == 12 or TYPE == 13:  # Q4_K / Q5_K: d, dmin, 12 bytes of scales, (qh,) qs
        sub = j0 // 32
        sc, mn = _k_scale_min(p, sub, p_ok)
        QS: tl.constexpr = 16 if TYPE == 12 else 48
        q = (_byte(p, QS + (j0 // 64) * 32 + jj, ok) >> ((sub % 2) * 4)) & 15
        if TYPE == 13:
            q = q | (((_byte(p, 16 + jj, ok) >> sub) & 1) << 4)
        w = (_f16(p, 0, p_ok) * sc) * exact_float(q, 0) - _f16(p, 2, p_ok) * mn
    elif TYPE == 10:  # Q2_K: 16 bytes of 4-bit scale | 4-bit min, 64 of 2-bit codes, d, dmin
        s0 = _byte(p, j0 // 16, p_ok)  # the run's two 16-weight scales, once an output
        s1 = _byte(p, j0 // 16 + 1, p_ok)
        d = _f16(p, 80, p_ok)
        dmin = _f16(p, 82, p_ok)
        q = (_byte(p, 16 + (j0 // 128) * 32 + jj, ok) >> (((j0 % 128) // 32) * 2)) & 3
        w = (_halves(jj, d * exact_float(s0 & 15, 0), d * exact_float(s1 & 15, 0)) * exact_float(q, 0)
             - _halves(jj, dmin * exact_float(s0 >> 4, 0), dmin * exact_float(s1 >> 4, 0)))
    elif TYPE == 11:  # Q3_K: 32 bytes of high bits, 64 of 2-bit codes, 12 of 6-bit scales, d
        d = _f16(p, 108, p_ok)
        q = (_byte(p, 32 + (j0 // 128) * 32 + jj, ok) >> (((j0 % 128) // 32) * 2)) & 3
        q = q | (((_byte(p, jj, ok) >> (j0 // 32)) & 1) << 2)  # less 4 below: high bit 0 is -4
        w = _halves(jj, d * _q3_k_scale(p, j0 // 16, p_ok),
                    d * _q3_k_scale(p, j0 // 16 + 1, p_ok)) * exact_float(q, 4)
    elif TYPE == 20:  # IQ4_NL: d, 16 bytes of nibbles indexing IQ4_VALUES
        q = (_byte(p, 2 + jj % 16, ok) >> ((jj // 16) * 4)) & 15
        w = _f16(p, 0, p_ok) * tl.load(lut_ptr + q)
    elif TYPE == 23:  # IQ4_XS: d, 2 bytes of scales' high bits, 4 of their low, 128 of nibbles
        sub = j0 // 32
        ls = (_byte(p, 4 + sub // 2, p_ok) >> ((sub % 2) * 4)) & 15
        ls = ls | ((((_byte(p, 2, p_ok) | (_byte(p, 3, p_ok) << 8)) >> (sub * 2)) & 3) << 4)
        q = (_byte(p, 8 + sub * 16 + jj % 16, ok) >> ((jj // 16) * 4)) & 15
        w = (_f16(p, 0, p_ok) * exact_float(ls, 32)) * tl.load(lut_ptr + q)
    else:  # Q6_K: 128 bytes of low nibbles, 64 of high pairs, 16 int8 scales, d
        half = j0 // 128
        r0 = j0 % 128
        q = (_byte(p, half * 64 + r0 % 64 + jj, ok) >> ((r0 // 64) * 4)) & 15
        q = q | (((_byte(p, 128 + half * 32 + jj, ok) >> ((r0 // 32) * 2)) & 3) << 4)
        d = _f16(p, 208, p_ok)
        w = _halves(jj, d * exact_float(_byte(p, 192 + j0 // 16, p_ok) ^ 128, 128),
                    d * exact_float(_byte(p, 193 + j0 // 16, p_ok) ^ 128, 128)) * exact_float(q, 32)
    return w


@triton.jit
def _gguf_matmul_kernel(
    x_ptr, w_ptr, lut_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split, stride_xm, stride_om, stride_os, stride_wn, magic,
    TYPE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_F32: tl.constexpr, ROUND_BF16: tl.constexpr,
    ONE_ROW: tl.constexpr, UNROLL: tl.constexpr, EVEN: tl.constexpr,
):
    """`magic`: 0x4B000000 (2**23's bits) at run time, for gguf_kgemv.py (see
    wn_gemv.placed_code). ONE_ROW: 1 the classic types' (and IQ4_NL's) one-row GEMV, 2 Q4_K /
    Q5_K's, 3 Q6_K's, 4 Q3_K's, 5 Q2_K's, 6 IQ4_XS's, 0 the decoder below (every type; the
    GEMV of 2-8 rows and the GEMM)."""
    tl.static_assert(BLOCK_K == 32)  # _decode's tile: one 32-weight run (k_per_split too)
    pid_m, split, rows, n, k_start, k_end = program_tile(M, N, K, k_per_split, BLOCK_M, BLOCK_N)
    rows_ok = rows < M
    n_ok = n < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]: each output's blocks
    if ONE_ROW == 1:  # gguf_gemv.py
        acc = classic_gemv(x_ptr + pid_m.to(tl.int64) * stride_xm, w_ptr, n, n_ok, k_start,
                           k_end, stride_wn, TYPE, BLOCK_BYTES, BLOCK_N, UNROLL, EVEN)
    elif ONE_ROW == 2:  # gguf_kgemv.py
        acc = kquant_gemv(x_ptr + pid_m.to(tl.int64) * stride_xm, w_ptr, n, n_ok, k_start,
                          k_end, stride_wn, magic, TYPE, BLOCK_BYTES, BLOCK_N, EVEN)
    elif ONE_ROW == 3:
        acc = q6k_gemv(x_ptr + pid_m.to(tl.int64) * stride_xm, w_ptr, n, n_ok, k_start, k_end,
                       stride_wn, magic, BLOCK_N, EVEN)
    elif ONE_ROW == 4:
        acc = q3k_gemv(x_ptr + pid_m.to(tl.int64) * stride_xm, w_ptr, n, n_ok, k_start, k_end,
                       stride_wn, magic, BLOCK_N, EVEN)
    elif ONE_ROW == 5:
        acc = q2k_gemv(x_ptr + pid_m.to(tl.int64) * stride_xm, w_ptr, n, n_ok, k_start, k_end,
                       stride_wn, magic, BLOCK_N, EVEN)
    elif ONE_ROW == 6:
        acc = iq4xs_gemv(x_ptr + pid_m.to(tl.int64) * stride_xm, w_ptr, n, n_ok, k_start,
                         k_end, stride_wn, BLOCK_N, EVEN)
    else:
        if USE_DOT:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        else:
            acc = gemv_zeros(BLOCK_M, BLOCK_N, BLOCK_K, 1)
        jj = tl.arange(0, BLOCK_K)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + jj
            k_ok = k < k_end
            w = _decode(w_rows + k0 // BLOCK * BLOCK_BYTES, k0 % BLOCK, jj[None, :],
                        n_ok[:, None] & k_ok[None, :], n_ok[:, None], lut_ptr, TYPE)
            if USE_DOT:
                acc = accumulate(acc, tl.trans(w), x_rows, rows_ok, k, k_ok, DOT_F32, ROUND_BF16)
            else:  # w [BLOCK_N, BLOCK_K] as decoded: K along axis 1
                acc = gemv_accumulate(acc, w, x_ptr, k, k_ok, pid_m, M, stride_xm, BLOCK_M, 1)
        if not USE_DOT:
            acc = gemv_rows(acc, BLOCK_M, 1)
    store_out(acc, bias_ptr, out_ptr, rows, rows_ok, n, n_ok, split, stride_om, stride_os,
              HAS_BIAS, ROUND_BF16)


@triton.jit
def _gguf_dequantize_kernel(w_ptr, lut_ptr, out_ptr, N, stride_wn, stride_on,
                            TYPE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                            BLOCK_N: tl.constexpr, RUNS: tl.constexpr, ROUND_BF16: tl.constexpr):
    """W [N, K] in out's dtype, RUNS 32-weight runs x BLOCK_N outputs a program (K / 32 / RUNS
    programs along K: the launcher picks RUNS to divide K / 32)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    jj = tl.arange(0, 32)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    out_rows = out_ptr + n.to(tl.int64)[:, None] * stride_on
    for r in tl.static_range(RUNS):
        k0 = (tl.program_id(1) * RUNS + r) * 32
        w = _decode(w_rows + k0 // BLOCK * BLOCK_BYTES, k0 % BLOCK, jj[None, :],
                    n_ok[:, None], n_ok[:, None], lut_ptr, TYPE)
        if ROUND_BF16:
            w = bf16_round(w)
        tl.store(out_rows + k0 + jj[None, :], w.to(out_ptr.dtype.element_ty), mask=n_ok[:, None])


def gguf_tiles(m: int, n: int, k: int, element_size: int = 2, type_name: str = "Q4_K",
               **gemv) -> dict:
    """`gguf_matmul`'s launch configuration: the weight-only tiles of quant_gemm.py with a K tile
    of 32 inputs (one classic block or one K-quant sub-block: a 64-deep tile's decode spills on
    NVIDIA in the GEMV, `python -m omniinfer.testing.kernels_aot --op gguf_gemv`). The GEMV's
    defaults were the H200's best for the byte decoder (benchmarks/gguf_tiles.py, 2026-12-04):
    K split until ~2048 programs run (512: 10-35% slower), 128 outputs a program for Q6_K and
    Q8_0, 64 for the rest (Q4_K: 128 was 15-20% slower). One row of Q2_K-Q6_K and IQ4_XS runs
    gguf_kgemv.py's GEMV: 128 outputs and splits of whole 256-blocks (not yet timed on a GPU;
    the sm_90 estimate prefers 256 outputs, which halves the programs). `gemv` (block_n,
    programs, num_warps) overrides them.
    """
    wide = type_name in ("Q6_K", "Q8_0") or (m == 1 and type_name in KQUANT_GEMV)
    gemv = {"block_n": 128 if wide else 64, "programs": 2048, **gemv}
    cfg = wn_tiles(m, n, k, 32, False, 4, element_size, **gemv)
    if type_name == "Q8_0" and 2 <= m <= GEMV_MAX_M and element_size == 2:
        # Q8_0's decode is cheap enough for tl.dot with the rows padded to 16 to win from 2 rows
        # (H200, bfloat16: 2-8 rows 0.48-0.98x the GEMV's time; 1 row 0.88-1.10x)
        cfg.update(BLOCK_M=16, USE_DOT=True)
    if m == 1 and type_name in KQUANT_GEMV:  # kquant_gemv's splits are whole 256-blocks
        cfg["split_k"], cfg["k_per_split"] = split_k(triton.cdiv(n, cfg["BLOCK_N"]), k, 256,
                                                     gemv["programs"])
    del cfg["GROUP_SIZE"], cfg["TILE_IN_ONE_GROUP"]
    return cfg


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, type_name: str,
                bias: torch.Tensor | None = None, tiles: dict | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for x [..., K] (float16/bfloat16/float32) and W [N, K] held as GGUF
    `type_name` blocks: uint8 [N, K / B * block_bytes] with contiguous rows. Returns [..., N]
    in x's dtype. `tiles` replaces gguf_tiles' launch configuration (benchmarks/gguf_tiles.py
    sweeps them)."""
    x2 = matrix_rows(x)
    m, k = x2.shape
    n = blocks.shape[0]
    kind = _checked(blocks, type_name, k)
    cfg = gguf_tiles(m, n, k, x.element_size(), type_name) if tiles is None else tiles
    if cfg["BLOCK_K"] != 32 or cfg["k_per_split"] % 32:
        raise ValueError(f"tiles={cfg}: the GGUF kernel decodes 32-weight runs (BLOCK_K 32, "
                         "k_per_split a multiple of 32)")
    lut = iq4_table(x.device, torch.float32)
    cfg = dict(cfg)
    unroll = cfg.pop("UNROLL", CLASSIC_UNROLL)
    one_row, even = 0, False
    if cfg.pop("ONE_ROW", None) == 0:  # (`tiles` may ask for the byte decoder: gguf_tiles.py)
        pass
    elif m == 1 and not cfg["USE_DOT"]:  # the one-row GEMVs, where the blocks are aligned for
        # their halfword or word loads (a view at an odd offset takes the byte decoder)
        if kind.code in CLASSIC_GEMV_TYPES and _aligned(blocks, 2):
            one_row = 1
            even = classic_gemv_even(n, k, cfg["BLOCK_N"], cfg["k_per_split"], unroll)
        elif type_name in KQUANT_GEMV and _aligned(blocks, KQUANT_GEMV[type_name]):
            if cfg["k_per_split"] % 256:  # (words or halfwords: rows are whole blocks)
                raise ValueError(f"tiles={cfg}: the one-row {type_name} GEMV splits K in whole "
                                 "256-weight blocks (k_per_split a multiple of 256)")
            one_row = {"Q6_K": 3, "Q3_K": 4, "Q2_K": 5, "IQ4_XS": 6}.get(type_name, 2)
            even = n % cfg["BLOCK_N"] == 0
    return launch_weight_only(_gguf_matmul_kernel, x, x2, (blocks, lut),
                              (blocks.stride(0), 0x4B000000), n, cfg, bias, TYPE=kind.code,
                              BLOCK=kind.block, BLOCK_BYTES=kind.block_bytes, ONE_ROW=one_row,
                              UNROLL=unroll, EVEN=even)


def gguf_dequantize(blocks: torch.Tensor, type_name: str, k: int, dtype: torch.dtype,
                    block_n: int = 32, runs: int = 8, num_warps: int = 4) -> torch.Tensor:
    """W [N, K] in `dtype` from its GGUF `type_name` blocks (uint8 [N, K / B * block_bytes],
    contiguous rows): gguf.quants.dequantize's float32 weights rounded once to `dtype`, as the
    reference (quantization/gguf_blocks.py) rounds them. The tiles' defaults were the H200's best
    or within 3% of it (benchmarks/gguf_tiles.py, 2026-12-04)."""
    kind = _checked(blocks, type_name, k)
    n = blocks.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=blocks.device)
    runs = max(r for r in (1, 2, 4, 8, 16) if r <= runs and (k // 32) % r == 0)
    if n and k:
        _gguf_dequantize_kernel[(triton.cdiv(n, block_n), k // 32 // runs)](
            blocks, iq4_table(blocks.device, torch.float32), out, n, blocks.stride(0),
            out.stride(0), TYPE=kind.code, BLOCK=kind.block, BLOCK_BYTES=kind.block_bytes,
            BLOCK_N=block_n, RUNS=runs, ROUND_BF16=INTERPRETED and dtype == torch.bfloat16,
            num_warps=num_warps)
    return out


def _aligned(blocks: torch.Tensor, unit: int) -> bool:
    """Whether every row of `blocks` starts on a multiple of `unit` bytes."""
    return blocks.data_ptr() % unit == 0 and blocks.stride(0) % unit == 0


def _checked(blocks: torch.Tensor, type_name: str, k: int):
    """`type_name`'s BlockType, once blocks are uint8 [N, row bytes of K] with contiguous rows."""
    if type_name not in KERNEL_TYPES:
        raise ValueError(f"type_name={type_name!r}: the GGUF kernel decodes {', '.join(KERNEL_TYPES)}")
    kind = BY_NAME[type_name]
    if k % kind.block:
        raise ValueError(f"x has K={k} inputs, not a whole number of {type_name} blocks of {kind.block}")
    if (blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != kind.row_bytes(k)
            or blocks.stride(1) != 1):
        raise ValueError(f"blocks must be uint8 [N, {kind.row_bytes(k)}] with contiguous rows for "
                         f"K={k} of {type_name}, got {blocks.dtype} {tuple(blocks.shape)} "
                         f"strides {blocks.stride()}")
    return kind

