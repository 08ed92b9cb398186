"""GGUF rows repacked in groups of 8 for the int8-activation products (csrc/quant_x8.c), as the
formats "cpu:Q4_0x8", "cpu:Q8_0x8", "cpu:Q4_1x8", "cpu:Q5_0x8", "cpu:Q5_1x8", "cpu:Q4_Kx8",
"cpu:Q5_Kx8", "cpu:Q6_Kx8", "cpu:IQ4_NLx8", "cpu:IQ4_XSx8", "cpu:Q2_Kx8" and "cpu:Q3_Kx8": the
same bytes as the blocks they come from, interleaved so that one 32-bit lane holds 4 codes of
one row (quant_blocks.h says the byte order). The piece replaces the original one in its layer
(the memory held stays the file's); the formats' dequantise and narrow undo the interleaving, so
an embedding that shares the weight (tied) still reads its rows."""

from __future__ import annotations

from functools import partial

import torch

from omniinfer.quantization.base import QuantPiece, dequantize_piece, narrow_piece, register_format
from omniinfer.quantization.gguf_blocks import BY_NAME

GROUP = 8
CHUNK_GROUPS = 512  # groups repacked at a time (bounds the transient copies)
# the classic 32-weight blocks of 4- and 5-bit codes: (has a minimum m, has fifth bits)
# (IQ4_NL: Q4_0's layout, its codes indexing IQ4_VALUES)
CLASSIC = {"Q4_0": (False, False), "Q4_1": (True, False), "Q5_0": (False, True), "Q5_1": (True, True),
           "IQ4_NL": (False, False)}


def _chunks(qs: torch.Tensor) -> torch.Tensor:
    """A classic block's 16 nibble bytes [G, 8, nb, 16] -> Q4_0x8's chunks [G, nb, 128] (byte 4r + i
    of chunk c: row r's weight 8c + i in the low nibble, 8c + 4 + i in the high one)."""
    groups, _, nb, _ = qs.shape
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(groups, GROUP, nb, 4, 2, 4)  # 8c + 4h + i
    return (codes[..., 0, :] | (codes[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(groups, nb, 128)


def _nibble_bytes(chunks: torch.Tensor) -> torch.Tensor:
    """_chunks' inverse: [G, nb, 128] -> [G, 8, nb, 16]."""
    groups, nb, _ = chunks.shape
    c = chunks.reshape(groups, nb, 4, GROUP, 4).permute(0, 3, 1, 2, 4)  # [G, r, nb, c, i]
    codes = torch.stack([c & 15, c >> 4], dim=-2).reshape(groups, GROUP, nb, 32)
    return codes[..., :16] | (codes[..., 16:] << 4)


_SHIFTS = (2 * torch.arange(4)[:, None] + torch.arange(2)[None, :])[..., None]  # [c, h, 1]: bit 2c + h


def _fifth_bits(bits: torch.Tensor) -> torch.Tensor:
    """Fifth bits [..., 8 (row), 32 (weight 8c + 4h + i)] (0 / 1) -> [..., 32]: byte 4r + i holds
    row r's weight 8c + 4h + i at bit 2c + h (quant_blocks.h)."""
    x = bits.reshape(*bits.shape[:-1], 4, 2, 4).to(torch.int32)
    return (x << _SHIFTS).sum(dim=(-3, -2)).to(torch.uint8).reshape(*bits.shape[:-2], 32)


def _bits_of(hb: torch.Tensor) -> torch.Tensor:
    """_fifth_bits' inverse: [..., 32] -> [..., 8, 32] (uint8 0 / 1)."""
    h = hb.reshape(*hb.shape[:-1], GROUP, 1, 1, 4)
    return ((h >> _SHIFTS.to(torch.uint8)) & 1).reshape(*hb.shape[:-1], GROUP, 32)


_BIT = torch.arange(8, dtype=torch.uint8)


def _pack_classic(b: torch.Tensor, has_min: bool, has_hi: bool) -> torch.Tensor:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks [G, 8, nb, size] -> [G, nb, 8 * size]: the 8 rows' d, their
    m (Q4_1, Q5_1), the low 4 bits of the codes as Q4_0x8's chunks, then (Q5) their fifth bits."""
    groups, _, nb, size = b.shape
    parts = [b[..., 0:2].permute(0, 2, 1, 3).reshape(groups, nb, 16)]
    if has_min:
        parts.append(b[..., 2:4].permute(0, 2, 1, 3).reshape(groups, nb, 16))
    parts.append(_chunks(b[..., size - 16:]))
    if has_hi:  # qh: a little-endian uint32, bit j weight j's fifth bit
        qh = b[..., 2 + 2 * has_min:6 + 2 * has_min]
        bits = ((qh[..., None] >> _BIT) & 1).reshape(groups, GROUP, nb, 32)
        parts.append(_fifth_bits(bits.permute(0, 2, 1, 3)))
    return torch.cat(parts, dim=-1)


def _unpack_classic(p: torch.Tensor, has_min: bool, has_hi: bool) -> torch.Tensor:
    """[G, nb, 8 * size] -> Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks [G, 8, nb, size]."""
    groups, nb, _ = p.shape
    parts = [p[..., :16].reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3)]
    at = 16
    if has_min:
        parts.append(p[..., 16:32].reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3))
        at = 32
    if has_hi:
        bits = _bits_of(p[..., at + 128:at + 160]).permute(0, 2, 1, 3).reshape(groups, GROUP, nb, 4, 8)
        parts.append((bits << _BIT).sum(dim=-1, dtype=torch.int32).to(torch.uint8))
    parts.append(_nibble_bytes(p[..., at:at + 128]))
    return torch.cat(parts, dim=-1)


def _pack_q5_k(b: torch.Tensor) -> torch.Tensor:
    """Q5_K blocks [G, 8, nb, 176] -> [G, nb, 1408]: Q4_Kx8's d, dmin and scales, then each
    sub-block's codes as Q4_Kx8's, followed by their fifth bits (qh byte l, bit s: sub-block s's
    weight l) as Q5_0x8's."""
    groups, _, nb, _ = b.shape
    p = _pack_q4_k(torch.cat([b[..., :16], b[..., 48:]], dim=-1))
    bits = ((b[..., 16:48].unsqueeze(-2) >> _BIT[:, None]) & 1)  # [G, r, nb, s, l]
    hb = _fifth_bits(bits.permute(0, 2, 3, 1, 4))  # [G, nb, s, 32]
    subs = torch.cat([p[..., 128:].reshape(groups, nb, 8, 128), hb], dim=-1)
    return torch.cat([p[..., :128], subs.reshape(groups, nb, 1280)], dim=-1)


def _unpack_q5_k(p: torch.Tensor) -> torch.Tensor:
    """[G, nb, 1408] -> Q5_K blocks [G, 8, nb, 176]."""
    groups, nb, _ = p.shape
    subs = p[..., 128:].reshape(groups, nb, 8, 160)
    q4 = _unpack_q4_k(torch.cat([p[..., :128], subs[..., :128].reshape(groups, nb, 1024)], dim=-1))
    bits = _bits_of(subs[..., 128:]).permute(0, 3, 1, 4, 2)  # [G, nb, s, r, l] -> [G, r, nb, l, s]
    qh = (bits << _BIT).sum(dim=-1, dtype=torch.int32).to(torch.uint8)
    return torch.cat([q4[..., :16], qh, q4[..., 16:]], dim=-1)


def _pack_q4_k(b: torch.Tensor) -> torch.Tensor:
    """Q4_K blocks [G, 8, nb, 144] -> [G, nb, 1152]: the 8 rows' d, dmin, scale bytes (byte t of
    row r at 8t + r), then each sub-block's codes as Q4_0x8's chunks (quant_blocks.h)."""
    groups, _, nb, _ = b.shape
    qs = b[..., 16:].reshape(groups, GROUP, nb, 4, 1, 32)  # run j: sub-block 2j low nibbles, 2j + 1 high
    codes = torch.cat([qs & 15, qs >> 4], dim=-2).reshape(groups, GROUP, nb, 8, 4, 2, 4)  # [s, c, h, i]
    packed = (codes[..., 0, :] | (codes[..., 1, :] << 4)).permute(0, 2, 3, 4, 1, 5)  # [G, nb, s, c, r, i]
    d, dmin = b[..., 0:2].permute(0, 2, 1, 3), b[..., 2:4].permute(0, 2, 1, 3)  # [G, nb, r, 2]
    scales = b[..., 4:16].permute(0, 2, 3, 1)  # [G, nb, t, r]
    return torch.cat([d.reshape(groups, nb, 16), dmin.reshape(groups, nb, 16), scales.reshape(groups, nb, 96),
                      packed.reshape(groups, nb, 1024)], dim=-1)


def _unpack_q4_k(p: torch.Tensor) -> torch.Tensor:
    """[G, nb, 1152] -> Q4_K blocks [G, 8, nb, 144]."""
    groups, nb, _ = p.shape
    d = p[..., :16].reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3)
    dmin = p[..., 16:32].reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3)
    scales = p[..., 32:128].reshape(groups, nb, 12, GROUP).permute(0, 3, 1, 2)
    c = p[..., 128:].reshape(groups, nb, 8, 4, GROUP, 4).permute(0, 4, 1, 2, 3, 5)  # [G, r, nb, s, c, i]
    codes = torch.stack([c & 15, c >> 4], dim=-2).reshape(groups, GROUP, nb, 4, 2, 32)  # [run j, h, l]
    qs = (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(groups, GROUP, nb, 128)
    return torch.cat([d, dmin, scales, qs], dim=-1)


def _pack_q6_k(b: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [G, 8, nb, 210] -> [G, nb, 1680]: the 8 rows' d, their scales (scale t of row r
    at 8t + r), then per sub-block its low 4 bits as Q4_0x8's chunks and its top 2 bits (quant_x8.c)."""
    groups, _, nb, _ = b.shape
    ql = b[..., :128].reshape(groups, GROUP, nb, 2, 1, 2, 32)  # [h, -, part & 1, l]
    lo = torch.cat([ql & 15, ql >> 4], dim=-3).reshape(groups, GROUP, nb, 8, 4, 2, 4)  # [s = 4h + part, c, hh, i]
    qh = b[..., 128:192].reshape(groups, GROUP, nb, 2, 1, 32)
    hi = torch.cat([(qh >> (2 * p)) & 3 for p in range(4)], dim=-2).reshape(groups, GROUP, nb, 8, 2, 2, 2, 4)
    low = (lo[..., 0, :] | (lo[..., 1, :] << 4)).permute(0, 2, 3, 4, 1, 5)  # [G, nb, s, c, r, i]
    top = (hi[..., 0, 0, :] | (hi[..., 0, 1, :] << 2) | (hi[..., 1, 0, :] << 4) | (hi[..., 1, 1, :] << 6))
    top = top.permute(0, 2, 3, 4, 1, 5)  # [G, nb, s, k, r, i]
    sub = torch.cat([low.reshape(groups, nb, 8, 128), top.reshape(groups, nb, 8, 64)], dim=-1)
    d = b[..., 208:210].permute(0, 2, 1, 3)  # [G, nb, r, 2]
    scales = b[..., 192:208].permute(0, 2, 3, 1)  # [G, nb, t, r]
    return torch.cat([d.reshape(groups, nb, 16), scales.reshape(groups, nb, 128), sub.reshape(groups, nb, 1536)], dim=-1)


def _unpack_q6_k(p: torch.Tensor) -> torch.Tensor:
    """[G, nb, 1680] -> Q6_K blocks [G, 8, nb, 210]."""
    groups, nb, _ = p.shape
    d = p[..., :16].reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3)
    scales = p[..., 16:144].reshape(groups, nb, 16, GROUP).permute(0, 3, 1, 2)
    sub = p[..., 144:].reshape(groups, nb, 8, 192)
    low = sub[..., :128].reshape(groups, nb, 8, 4, GROUP, 4).permute(0, 4, 1, 2, 3, 5)  # [G, r, nb, s, c, i]
    top = sub[..., 128:].reshape(groups, nb, 8, 2, GROUP, 4).permute(0, 4, 1, 2, 3, 5)  # [G, r, nb, s, k, i]
    lo = torch.stack([low & 15, low >> 4], dim=-2)  # [G, r, nb, s, c, hh, i]
    hi = torch.stack([torch.stack([(top >> (4 * cc + 2 * hh)) & 3 for hh in range(2)], dim=-2)
                      for cc in range(2)], dim=-3)  # [G, r, nb, s, k, cc, hh, i]
    lo = lo.reshape(groups, GROUP, nb, 2, 2, 2, 32)  # [h, part >= 2, part & 1, l]
    ql = (lo[..., 0, :, :] | (lo[..., 1, :, :] << 4)).reshape(groups, GROUP, nb, 128)
    hi = hi.reshape(groups, GROUP, nb, 2, 4, 32)  # [h, part, l]
    qh = (hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)).reshape(groups, GROUP, nb, 64)
    return torch.cat([ql, qh, scales, d], dim=-1)


def _pack_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    """IQ4_XS blocks [G, 8, nb, 136] -> [G, nb, 1088]: the 8 rows' d, their 2 scales_h bytes (byte
    k of row r at 16 + 8k + r), their 4 scales_l bytes (byte t at 32 + 8t + r), then each
    sub-block's 16 nibble bytes as Q4_0x8's chunks."""
    groups, _, nb, _ = b.shape
    d = b[..., 0:2].permute(0, 2, 1, 3).reshape(groups, nb, 16)
    high, low = b[..., 2:4].permute(0, 2, 3, 1), b[..., 4:8].permute(0, 2, 3, 1)  # [G, nb, byte, r]
    codes = _chunks(b[..., 8:].reshape(groups, GROUP, nb * 8, 16)).reshape(groups, nb, 1024)
    return torch.cat([d, high.reshape(groups, nb, 16), low.reshape(groups, nb, 32), codes], dim=-1)


def _unpack_iq4_xs(p: torch.Tensor) -> torch.Tensor:
    """[G, nb, 1088] -> IQ4_XS blocks [G, 8, nb, 136]."""
    groups, nb, _ = p.shape
    d = p[..., :16].reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3)
    high = p[..., 16:32].reshape(groups, nb, 2, GROUP).permute(0, 3, 1, 2)
    low = p[..., 32:64].reshape(groups, nb, 4, GROUP).permute(0, 3, 1, 2)
    qs = _nibble_bytes(p[..., 64:].reshape(groups, nb * 8, 128)).reshape(groups, GROUP, nb, 128)
    return torch.cat([d, high, low, qs], dim=-1)


_CRUMB = 2 * torch.arange(4, dtype=torch.uint8)  # a 2-bit code's shift in its byte


def _pack_crumbs(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K / Q3_K 2-bit codes [G, 8, nb, 64] (weight 128n + 32j + l: byte 32n + l, bits 2j) -> per
    sub-block s 2 vectors of 32 bytes, [G, nb, 8, 64]: bits 2b, 2b + 1 of byte 4r + i of vector a
    hold row r's weight 32s + 4 (4a + b) + i."""
    groups, _, nb, _ = qs.shape
    codes = ((qs.reshape(groups, GROUP, nb, 2, 1, 32) >> _CRUMB[:, None]) & 3).reshape(groups, GROUP, nb, 8, 2, 4, 4)
    packed = (codes << _CRUMB[:, None]).sum(dim=-2, dtype=torch.int32).to(torch.uint8)  # [G, r, nb, s, a, i]
    return packed.permute(0, 2, 3, 4, 1, 5).reshape(groups, nb, 8, 64)


def _unpack_crumbs(p: torch.Tensor) -> torch.Tensor:
    """_pack_crumbs' inverse: [G, nb, 8, 64] -> [G, 8, nb, 64]."""
    groups, nb = p.shape[:2]
    packed = p.reshape(groups, nb, 8, 2, GROUP, 4).permute(0, 4, 1, 2, 3, 5)  # [G, r, nb, s, a, i]
    codes = ((packed.unsqueeze(-2) >> _CRUMB[:, None]) & 3).reshape(groups, GROUP, nb, 2, 4, 32)  # [n, j, l]
    return (codes << _CRUMB[:, None]).sum(dim=-2, dtype=torch.int32).to(torch.uint8).reshape(groups, GROUP, nb, 64)


def _rows_last(b: torch.Tensor) -> torch.Tensor:
    """[G, 8, nb, n] bytes -> [G, nb, 8n]: byte t of row r at 8t + r."""
    return b.permute(0, 2, 3, 1).reshape(b.shape[0], b.shape[2], -1)


def _rows_back(p: torch.Tensor) -> torch.Tensor:
    """_rows_last's inverse: [G, nb, 8n] -> [G, 8, nb, n]."""
    return p.reshape(p.shape[0], p.shape[1], -1, GROUP).permute(0, 3, 1, 2)


def _pack_q2_k(b: torch.Tensor) -> torch.Tensor:
    """Q2_K blocks [G, 8, nb, 84] -> [G, nb, 672]: the 8 rows' d, dmin, scale bytes (byte t of row r
    at 32 + 8t + r), then per sub-block its codes as _pack_crumbs's."""
    groups, _, nb, _ = b.shape
    d, dmin = b[..., 80:82].permute(0, 2, 1, 3), b[..., 82:84].permute(0, 2, 1, 3)  # [G, nb, r, 2]
    return torch.cat([d.reshape(groups, nb, 16), dmin.reshape(groups, nb, 16), _rows_last(b[..., :16]),
                      _pack_crumbs(b[..., 16:80]).reshape(groups, nb, 512)], dim=-1)


def _unpack_q2_k(p: torch.Tensor) -> torch.Tensor:
    """[G, nb, 672] -> Q2_K blocks [G, 8, nb, 84]."""
    groups, nb, _ = p.shape
    d = p[..., :16].reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3)
    dmin = p[..., 16:32].reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3)
    qs = _unpack_crumbs(p[..., 160:].reshape(groups, nb, 8, 64))
    return torch.cat([_rows_back(p[..., 32:160]), qs, d, dmin], dim=-1)


def _pack_q3_k(b: torch.Tensor) -> torch.Tensor:
    """Q3_K blocks [G, 8, nb, 110] -> [G, nb, 880]: the 8 rows' d, their 12 scale bytes (byte t of
    row r at 16 + 8t + r), then per sub-block s its 2-bit codes as _pack_crumbs's and their hmask
    bits (hmask byte l, bit s: weight 32s + l) as _fifth_bits puts them (bit k of byte 4r + i: row
    r's weight 32s + 4k + i)."""
    groups, _, nb, _ = b.shape
    d = b[..., 108:110].permute(0, 2, 1, 3).reshape(groups, nb, 16)
    bits = (b[..., :32].unsqueeze(-2) >> _BIT[:, None]) & 1  # [G, r, nb, s, l]
    high = _fifth_bits(bits.permute(0, 2, 3, 1, 4))  # [G, nb, s, 32]
    subs = torch.cat([_pack_crumbs(b[..., 32:96]), high], dim=-1)
    return torch.cat([d, _rows_last(b[..., 96:108]), subs.reshape(groups, nb, 768)], dim=-1)


def _unpack_q3_k(p: torch.Tensor) -> torch.Tensor:
    """[G, nb, 880] -> Q3_K blocks [G, 8, nb, 110]."""
    groups, nb, _ = p.shape
    d = p[..., :16].reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3)
    subs = p[..., 112:].reshape(groups, nb, 8, 96)
    bits = _bits_of(subs[..., 64:]).permute(0, 3, 1, 4, 2)  # [G, nb, s, r, l] -> [G, r, nb, l, s]
    hmask = (bits << _BIT).sum(dim=-1, dtype=torch.int32).to(torch.uint8)
    return torch.cat([hmask, _unpack_crumbs(subs[..., :64]), _rows_back(p[..., 16:112]), d], dim=-1)


def _pack_q8_0(b: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks [G, 8, nb, 34] -> [G, nb, 272]: the 8 rows' d, then chunk j's byte 4r + i: row r's
    weight 4j + i."""
    groups, _, nb, _ = b.shape
    d = b[..., :2].permute(0, 2, 1, 3).reshape(groups, nb, 16)
    return torch.cat([d, b[..., 2:].reshape(groups, GROUP, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, nb, 256)],
                     dim=-1)


def _unpack_q8_0(p: torch.Tensor) -> torch.Tensor:
    """[G, nb, 272] -> Q8_0 blocks [G, 8, nb, 34]."""
    groups, nb, _ = p.shape
    d = p[..., :16].reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3)
    qs = p[..., 16:].reshape(groups, nb, 8, GROUP, 4).permute(0, 3, 1, 2, 4).reshape(groups, GROUP, nb, 32)
    return torch.cat([d, qs], dim=-1)


# GGUF type -> (pack, unpack): blocks [G, 8, nb, size] <-> [G, nb, 8 * size]
PACKERS = {"Q8_0": (_pack_q8_0, _unpack_q8_0), "Q4_K": (_pack_q4_k, _unpack_q4_k),
           "Q5_K": (_pack_q5_k, _unpack_q5_k), "Q6_K": (_pack_q6_k, _unpack_q6_k),
           "IQ4_XS": (_pack_iq4_xs, _unpack_iq4_xs), "Q2_K": (_pack_q2_k, _unpack_q2_k),
           "Q3_K": (_pack_q3_k, _unpack_q3_k),
           **{name: (partial(_pack_classic, has_min=m, has_hi=h), partial(_unpack_classic, has_min=m, has_hi=h))
              for name, (m, h) in CLASSIC.items()}}
# original kind -> (repacked kind, the original's block bytes)
REPACKED = {f"gguf:{name}": (f"cpu:{name}x8", BY_NAME[name].block_bytes) for name in PACKERS}
ORIGINAL = {packed: kind for kind, (packed, _) in REPACKED.items()}


def _pack(blocks: torch.Tensor, cols: int, name: str) -> torch.Tensor:
    """GGUF `name` blocks uint8 [8G, nb * size] -> uint8 [G, nb * 8 * size]."""
    t, groups = BY_NAME[name], blocks.shape[0] // GROUP
    b = blocks.reshape(groups, GROUP, cols // t.block, t.block_bytes)
    return PACKERS[name][0](b).reshape(groups, -1)


def _unpack(packed: torch.Tensor, cols: int, name: str) -> torch.Tensor:
    """uint8 [G, nb * 8 * size] -> the `name` blocks, uint8 [8G, nb * size]."""
    t, groups = BY_NAME[name], packed.shape[0]
    p = packed.reshape(groups, cols // t.block, GROUP * t.block_bytes)
    return PACKERS[name][1](p).reshape(groups * GROUP, cols // t.block * t.block_bytes)


def repack(kind: str, blocks: torch.Tensor, shape: tuple[int, int]) -> QuantPiece:
    """`kind` blocks [rows, cols / block * size] (a last group padded with zero rows) as its repacked piece."""
    rows, cols = shape
    packed_kind, name = REPACKED[kind][0], kind.split(":")[1]
    groups = -(-rows // GROUP)
    out = torch.empty(groups, BY_NAME[name].row_bytes(cols) * GROUP, dtype=torch.uint8)
    for g0 in range(0, groups, CHUNK_GROUPS):
        g1 = min(groups, g0 + CHUNK_GROUPS)
        part = blocks[g0 * GROUP:g1 * GROUP]
        if part.shape[0] < (g1 - g0) * GROUP:
            part = torch.cat([part, part.new_zeros((g1 - g0) * GROUP - part.shape[0], part.shape[1])])
        out[g0:g1] = _pack(part, cols, name)
    return QuantPiece(packed_kind, shape, {"blocks8": out})


def as_original(piece: QuantPiece, groups: slice | torch.Tensor | None = None) -> QuantPiece:
    """The piece's rows (of the groups chosen, else all) as a piece of the kind they came from."""
    rows, cols = piece.shape
    kind = ORIGINAL[piece.kind]
    name, packed = kind.split(":")[1], piece.tensors["blocks8"]
    if groups is None:
        return QuantPiece(kind, (rows, cols), {"blocks": _unpack(packed, cols, name)[:rows]})
    sub = packed[groups]
    return QuantPiece(kind, (sub.shape[0] * GROUP, cols), {"blocks": _unpack(sub, cols, name)})


def _dequantize(piece: QuantPiece) -> torch.Tensor:
    return dequantize_piece(as_original(piece))


def _narrow(piece: QuantPiece, dim: int, start, length: int | None = None) -> QuantPiece:
    if dim != 0:
        return narrow_piece(as_original(piece), dim, start, length)
    if isinstance(start, torch.Tensor):  # rows by index (an embedding's lookup): only their groups
        groups, inverse = torch.unique(start // GROUP, return_inverse=True)
        return narrow_piece(as_original(piece, groups), 0, inverse * GROUP + start % GROUP)
    g0, g1 = start // GROUP, -(-(start + length) // GROUP)
    return narrow_piece(as_original(piece, slice(g0, g1)), 0, start - g0 * GROUP, length)


register_format("cpu", _dequantize, _narrow, None)
