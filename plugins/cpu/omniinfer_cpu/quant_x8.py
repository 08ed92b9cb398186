"""Q4_0 rows repacked in groups of 8 for the int8-activation products (csrc/quant_x8.c), as the
format "cpu:Q4_0x8": the same bytes as the Q4_0 blocks they come from, interleaved so that one
32-bit lane holds 4 codes of one row (quant_blocks.h says the byte order). The piece replaces the
Q4_0 one in its layer (the memory held stays the file's); the format's dequantise and narrow
undo the interleaving, so an embedding that shares the weight (tied) still reads its rows."""

from __future__ import annotations

import torch

from omniinfer.quantization.base import QuantPiece, dequantize_piece, narrow_piece, register_format

KIND = "cpu:Q4_0x8"
GROUP = 8
CHUNK_GROUPS = 512  # groups repacked at a time (bounds the transient copies)


def _pack(blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """Q4_0 blocks uint8 [8G, nb * 18] -> Q4_0X8 uint8 [G, nb * 144]."""
    nb = cols // 32
    groups = blocks.shape[0] // GROUP
    b = blocks.reshape(groups, GROUP, nb, 18)
    qs = b[..., 2:]  # byte j: weight j (low nibble), weight j + 16 (high)
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(groups, GROUP, nb, 4, 2, 4)  # weight 8c + 4h + i
    packed = (codes[..., 0, :] | (codes[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [G, nb, c, r, i]
    d = b[..., :2].permute(0, 2, 1, 3)  # [G, nb, r, 2]
    return torch.cat([d.reshape(groups, nb, 16), packed.reshape(groups, nb, 128)], dim=-1).reshape(groups, -1)


def _unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Q4_0X8 uint8 [G, nb * 144] -> Q4_0 blocks uint8 [8G, nb * 18]."""
    nb = cols // 32
    groups = packed.shape[0]
    p = packed.reshape(groups, nb, 144)
    d = p[..., :16].reshape(groups, nb, GROUP, 2).permute(0, 2, 1, 3)  # [G, r, nb, 2]
    c = p[..., 16:].reshape(groups, nb, 4, GROUP, 4).permute(0, 3, 1, 2, 4)  # [G, r, nb, c, i]
    codes = torch.stack([c & 15, c >> 4], dim=-2).reshape(groups, GROUP, nb, 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([d, qs], dim=-1).reshape(groups * GROUP, nb * 18)


def repack(blocks: torch.Tensor, shape: tuple[int, int]) -> QuantPiece:
    """Q4_0 blocks [rows, cols / 32 * 18] (a last group padded with zero rows) as a cpu:Q4_0x8 piece."""
    rows, cols = shape
    groups = -(-rows // GROUP)
    out = torch.empty(groups, cols // 32 * 144, dtype=torch.uint8)
    for g0 in range(0, groups, CHUNK_GROUPS):
        g1 = min(groups, g0 + CHUNK_GROUPS)
        part = blocks[g0 * GROUP:g1 * GROUP]
        if part.shape[0] < (g1 - g0) * GROUP:
            part = torch.cat([part, part.new_zeros((g1 - g0) * GROUP - part.shape[0], part.shape[1])])
        out[g0:g1] = _pack(part, cols)
    return QuantPiece(KIND, shape, {"blocks8": out})


def as_q4_0(piece: QuantPiece, groups: slice | torch.Tensor | None = None) -> QuantPiece:
    """The piece's rows (of the groups chosen, else all) as a gguf:Q4_0 piece."""
    rows, cols = piece.shape
    packed = piece.tensors["blocks8"]
    if groups is None:
        return QuantPiece("gguf:Q4_0", (rows, cols), {"blocks": _unpack(packed, cols)[:rows]})
    sub = packed[groups]
    return QuantPiece("gguf:Q4_0", (sub.shape[0] * GROUP, cols), {"blocks": _unpack(sub, cols)})


def _dequantize(piece: QuantPiece) -> torch.Tensor:
    return dequantize_piece(as_q4_0(piece))


def _narrow(piece: QuantPiece, dim: int, start, length: int | None = None) -> QuantPiece:
    if dim != 0:
        return narrow_piece(as_q4_0(piece), dim, start, length)
    if isinstance(start, torch.Tensor):  # rows by index (an embedding's lookup): only their groups
        groups, inverse = torch.unique(start // GROUP, return_inverse=True)
        sub = as_q4_0(piece, groups)
        return narrow_piece(sub, 0, inverse * GROUP + start % GROUP)
    g0, g1 = start // GROUP, -(-(start + length) // GROUP)
    sub = as_q4_0(piece, slice(g0, g1))
    return narrow_piece(sub, 0, start - g0 * GROUP, length)


register_format("cpu", _dequantize, _narrow, None)
