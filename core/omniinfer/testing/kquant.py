"""Round-to-nearest quantisers for GGUF's K-quants (Q4_K, Q5_K, Q6_K), which the `gguf` package
dequantises but cannot make: for test files and benchmarks on this machine. They write valid
blocks in llama.cpp's layout (the packing is checked by `gguf.quants.dequantize` reading them back
close to the weights); they do not search for the best scales as llama.cpp's quantiser does, so a
real Q4_K_M file (llama.cpp's `llama-quantize`) is somewhat more accurate. And random blocks of
every quantised type, for tests and kernel benchmarks: every byte random but the float16 scales."""

from __future__ import annotations

import numpy as np

# where each type keeps its float16 scales (byte offsets in a block)
SCALE_OFFSETS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
                 "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(kind, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, kind.row_bytes(cols)] uint8 of GGUF `kind` (a gguf_blocks.BlockType): random codes,
    sub-scales and bits, with float16 scales drawn from N(0, 0.05) (random bytes there would make
    infinities and NaNs)."""
    data = rng.integers(0, 256, size=(rows, kind.row_bytes(cols)), dtype=np.uint8)
    blocks = data.reshape(-1, kind.block_bytes)
    for at in SCALE_OFFSETS.get(kind.name, []):
        scales = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return data


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _scale_min_pack(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> [n, 12] bytes (Q4_K / Q5_K)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    lo_sc, hi_sc, lo_m, hi_m = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    out[:, 0:4] = lo_sc | ((hi_sc >> 4) << 6)
    out[:, 4:8] = lo_m | ((hi_m >> 4) << 6)
    out[:, 8:12] = (hi_sc & 0x0F) | ((hi_m & 0x0F) << 4)
    return out


def _affine(w: np.ndarray, levels: int):
    """Per 32-weight sub-block: (d, dmin, sc, mn, q) with w ~ d * sc * q - dmin * mn."""
    n = w.shape[0]
    sub = w.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=2), 0.0)
    hi = sub.max(axis=2)
    step = (hi - lo) / levels
    offset = -lo
    d = np.maximum(step.max(axis=1), 1e-12) / 63.0
    dmin = np.maximum(offset.max(axis=1), 1e-12) / 63.0
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d16 == 0, 1, d16)[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(offset / np.where(dmin16 == 0, 1, dmin16)[:, None]), 0, 63).astype(np.uint8)
    scale = (d16[:, None] * sc)[:, :, None]
    q = np.round((sub + (dmin16[:, None] * mn)[:, :, None]) / np.where(scale == 0, 1, scale))
    q = np.clip(q, 0, levels).astype(np.uint8)
    return d, dmin, sc, mn, q.reshape(n, 256)


def q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float -> [rows, cols / 256 * 144] bytes."""
    rows = w.shape[0]
    blocks = w.reshape(-1, 256).astype(np.float32)
    d, dmin, sc, mn, q = _affine(blocks, 15)
    chunks = q.reshape(-1, 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    out = np.concatenate([_f16(d), _f16(dmin), _scale_min_pack(sc, mn), qs], axis=1)
    return out.reshape(rows, -1)


def q5_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    blocks = w.reshape(-1, 256).astype(np.float32)
    d, dmin, sc, mn, q = _affine(blocks, 31)
    low = q & 0x0F
    chunks = low.reshape(-1, 4, 2, 32)
    qs = (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 8, 32)
    qh = np.zeros((blocks.shape[0], 32), dtype=np.uint8)
    for s in range(8):
        qh |= (high[:, s] << s).astype(np.uint8)
    out = np.concatenate([_f16(d), _f16(dmin), _scale_min_pack(sc, mn), qh, qs], axis=1)
    return out.reshape(rows, -1)


def q6_k(w: np.ndarray) -> np.ndarray:
    rows = w.shape[0]
    blocks = w.reshape(-1, 256).astype(np.float32)
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    amax = np.abs(sub).max(axis=2)
    scale = amax / 31.0
    d = np.maximum(np.abs(scale).max(axis=1), 1e-12) / 127.0
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d16 == 0, 1, d16)[:, None]), -128, 127).astype(np.int8)
    step = d16[:, None] * sc.astype(np.float32)
    q = np.where(step[:, :, None] != 0, np.round(sub / np.where(step == 0, 1, step)[:, :, None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    ql = np.zeros((n, 128), dtype=np.uint8)
    qh = np.zeros((n, 64), dtype=np.uint8)
    for h in range(2):
        q1, q2, q3, q4 = (q[:, 128 * h + 32 * i:128 * h + 32 * (i + 1)] for i in range(4))
        ql[:, 64 * h:64 * h + 32] = (q1 & 0x0F) | ((q3 & 0x0F) << 4)
        ql[:, 64 * h + 32:64 * h + 64] = (q2 & 0x0F) | ((q4 & 0x0F) << 4)
        qh[:, 32 * h:32 * h + 32] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
    out = np.concatenate([ql, qh, sc.view(np.uint8), _f16(d)], axis=1)
    return out.reshape(rows, -1)


QUANTIZERS = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}
