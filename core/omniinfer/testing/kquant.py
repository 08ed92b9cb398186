"""Round-to-nearest quantisers for GGUF's K-quants (Q2_K ... Q6_K) and IQ4 types (IQ4_NL, IQ4_XS),
which the `gguf` package dequantises but cannot make: for test files and benchmarks on this machine. They write valid
blocks in llama.cpp's layout (the packing is checked by `gguf.quants.dequantize` reading them back
close to the weights); they do not search for the best scales as llama.cpp's quantiser does, so a
real Q4_K_M file (llama.cpp's `llama-quantize`) is somewhat more accurate. And random blocks of
every quantised type, for tests and kernel benchmarks: every byte random but the float16 scales."""

from __future__ import annotations

import numpy as np

from omniinfer.quantization.gguf_blocks import IQ4_VALUES

# where each type keeps its float16 scales (byte offsets in a block)
SCALE_OFFSETS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2],
                 "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108],
                 "IQ4_NL": [0], "IQ4_XS": [0], "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0],
                 "IQ3_S": [0], "IQ1_S": [0], "IQ1_M": []}  # (IQ1_M: its d is in the scale words' top nibbles)


def random_blocks(kind, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, kind.row_bytes(cols)] uint8 of GGUF `kind` (a gguf_blocks.BlockType): random codes,
    sub-scales and bits, with float16 scales drawn from N(0, 0.05) (random bytes there would make
    infinities and NaNs)."""
    data = rng.integers(0, 256, size=(rows, kind.row_bytes(cols)), dtype=np.uint8)
    blocks = data.reshape(-1, kind.block_bytes)
    for at in SCALE_OFFSETS.get(kind.name, []):
        scales = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, at:at + 2] = scales.view(np.uint8).reshape(-1, 2)
    if kind.name == "IQ1_M":  # d's 4 nibbles, lowest first, are the top nibbles of the 4 scale words
        d = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16).view(np.uint16)
        for i in range(4):
            high = 48 + 2 * i + 1
            blocks[:, high] = (blocks[:, high] & 0x0F) | (((d >> (4 * i)) & 0x0F) << 4).astype(np.uint8)
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


def _crumb_pack(q: np.ndarray) -> np.ndarray:
    """[n, 256] 2-bit codes -> [n, 64] bytes: byte 32h + l holds weights 128h + 32s + l in bits 2s."""
    runs = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return (runs[:, :, 0] | (runs[:, :, 1] << 2) | (runs[:, :, 2] << 4) | (runs[:, :, 3] << 6)).reshape(-1, 64)


def _safe(x: np.ndarray) -> np.ndarray:
    return np.where(x == 0, 1, x)


def q2_k(w: np.ndarray) -> np.ndarray:
    """Per 16 weights w ~ (d * a) * q - dmin * b, q in [0, 3], 4-bit a and b; d, dmin per 256."""
    rows = w.shape[0]
    sub = w.reshape(-1, 16, 16).astype(np.float32)
    n = sub.shape[0]
    lo, hi = np.minimum(sub.min(axis=2), 0.0), np.maximum(sub.max(axis=2), 0.0)
    step, offset = (hi - lo) / 3, -lo
    d16 = (np.maximum(step.max(axis=1), 1e-12) / 15).astype(np.float16).astype(np.float32)
    dmin16 = (np.maximum(offset.max(axis=1), 1e-12) / 15).astype(np.float16).astype(np.float32)
    a = np.clip(np.round(step / _safe(d16)[:, None]), 0, 15).astype(np.uint8)
    b = np.clip(np.round(offset / _safe(dmin16)[:, None]), 0, 15).astype(np.uint8)
    scale = (d16[:, None] * a)[:, :, None]
    q = np.clip(np.round((sub + (dmin16[:, None] * b)[:, :, None]) / _safe(scale)), 0, 3).reshape(n, 256)
    out = np.concatenate([a | (b << 4), _crumb_pack(q), _f16(d16), _f16(dmin16)], axis=1)
    return out.reshape(rows, -1)


def q3_k(w: np.ndarray) -> np.ndarray:
    """Per 16 weights w ~ (d * s) * q, q in [-4, 3], s a 6-bit scale less 32; d per 256."""
    rows = w.shape[0]
    sub = w.reshape(-1, 16, 16).astype(np.float32)
    n = sub.shape[0]
    scale = np.abs(sub).max(axis=2) / 4
    d16 = (np.maximum(scale.max(axis=1), 1e-12) / 31).astype(np.float16).astype(np.float32)
    s = np.clip(np.round(scale / _safe(d16)[:, None]), -32, 31).astype(np.int32)
    step = (d16[:, None] * s)[:, :, None]
    q = np.clip(np.round(sub / _safe(step)), -4, 3).astype(np.int32).reshape(n, 256)
    low, high = np.where(q < 0, q + 4, q), (q >= 0).astype(np.uint8)  # high bit 0: q = low - 4
    hmask = np.zeros((n, 32), dtype=np.uint8)
    for bit in range(8):
        hmask |= high[:, 32 * bit:32 * (bit + 1)] << bit
    u = (s + 32).astype(np.uint8)
    scales = np.concatenate([(u[:, :8] & 0x0F) | ((u[:, 8:] & 0x0F) << 4),
                             (u[:, 0:4] >> 4) | ((u[:, 4:8] >> 4) << 2) | ((u[:, 8:12] >> 4) << 4)
                             | ((u[:, 12:16] >> 4) << 6)], axis=1)
    return np.concatenate([hmask, _crumb_pack(low), scales, _f16(d16)], axis=1).reshape(rows, -1)


def _iq4_codes(x: np.ndarray) -> np.ndarray:
    """The index of the nearest IQ4 value to each of x (in units of the block's scale): the values
    are ascending, so the number of midpoints between neighbours below x (no [..., 16] temporary:
    a 128k-token embedding is 262M weights)."""
    values = np.array(IQ4_VALUES, dtype=np.float32)
    return np.searchsorted((values[1:] + values[:-1]) / 2, x).astype(np.uint8)


def _signed_max(x: np.ndarray) -> np.ndarray:
    """Along the last axis: the value of largest magnitude, with its sign."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=-1)[..., None], axis=-1)[..., 0]


def iq4_nl(w: np.ndarray) -> np.ndarray:
    """Per 32 weights w ~ d * IQ4_VALUES[code]; the largest weight maps to -127 (its sign in d)."""
    rows = w.shape[0]
    blocks = w.reshape(-1, 32).astype(np.float32)
    d16 = (_signed_max(blocks) / -127).astype(np.float16).astype(np.float32)
    q = _iq4_codes(blocks / _safe(d16)[:, None])
    return np.concatenate([_f16(d16), q[:, :16] | (q[:, 16:] << 4)], axis=1).reshape(rows, -1)


def iq4_xs(w: np.ndarray) -> np.ndarray:
    """Per 32 weights w ~ (d * s) * IQ4_VALUES[code], s a 6-bit scale less 32; d per 256."""
    rows = w.shape[0]
    sub = w.reshape(-1, 8, 32).astype(np.float32)
    n = sub.shape[0]
    scale = _signed_max(sub) / -127
    d16 = (np.maximum(np.abs(scale).max(axis=1), 1e-12) / 31).astype(np.float16).astype(np.float32)
    s = np.clip(np.round(scale / _safe(d16)[:, None]), -32, 31).astype(np.int32)
    q = _iq4_codes(sub / _safe(d16[:, None] * s)[:, :, None])
    u = (s + 32).astype(np.uint16)
    high = np.zeros(n, dtype=np.uint16)
    for i in range(8):
        high |= (u[:, i] >> 4) << (2 * i)
    low = (u & 0x0F).astype(np.uint8)
    qs = (q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, 128)
    return np.concatenate([_f16(d16), high.view(np.uint8).reshape(n, 2), low[:, 0::2] | (low[:, 1::2] << 4), qs],
                          axis=1).reshape(rows, -1)


QUANTIZERS = {"Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k, "Q2_K": q2_k, "Q3_K": q3_k, "IQ4_NL": iq4_nl,
              "IQ4_XS": iq4_xs}


def lattice_noise(name: str, seed: int = 0):
    """A stand-in quantiser for llama.cpp's lattice types (IQ1/IQ2/IQ3), which neither the gguf
    package nor this module quantises: it ignores the weights but for their size and returns
    random blocks (every grid entry and sign) whose weights have the rows' rms. A model written so
    is a random model; tests compare it with transformers on the same file's numbers."""
    from omniinfer.quantization import gguf_blocks

    kind = gguf_blocks.BY_NAME[name]
    rng = np.random.default_rng(seed)

    def quantise(rows: np.ndarray) -> np.ndarray:
        import torch

        data = random_blocks(kind, rows.shape[0], rows.shape[1], rng)
        blocks = data.reshape(-1, kind.block_bytes)
        unit = np.ones(blocks.shape[0], dtype=np.float16).view(np.uint16)
        _set_lattice_d(name, blocks, unit)
        rms = float(gguf_blocks.dequantize(torch.from_numpy(data), kind, rows.shape[1]).square().mean().sqrt())
        d = np.full(blocks.shape[0], float(np.sqrt(np.mean(rows.astype(np.float64) ** 2))) / rms)
        _set_lattice_d(name, blocks, (d * rng.uniform(0.5, 1.5, d.shape)).astype(np.float16).view(np.uint16))
        return data

    return quantise


def _set_lattice_d(name: str, blocks: np.ndarray, bits: np.ndarray) -> None:
    """Each block's float16 d (as uint16 bits): its first 2 bytes, or IQ1_M's scale words' top nibbles."""
    if name != "IQ1_M":
        blocks[:, :2] = bits.view(np.uint8).reshape(-1, 2)
        return
    for i in range(4):
        blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (((bits >> (4 * i)) & 0x0F) << 4).astype(np.uint8)
