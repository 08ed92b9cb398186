"""llama.cpp's lattice types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M): blocks of 256
weights whose groups of 4 or 8 are an entry of a fixed grid of small integers, with signs, times a
scale of 16 or 32 weights. The grids and the sign table are data of the format; they are read from
the `gguf` package (its `quants` module holds them as llama.cpp does), not written out here.

Each type is parsed into `(scale, code)`: float32 scales [n, groups] and int8 codes [n, 256], with
weight j = scale[j // (256 / groups)] * code[j]. Both sides of that product are exact in float32
(an 11-bit float16 times a factor of at most 5 bits, a code of at most 7), so it is the reference's
value bit for bit (tests/test_gguf_blocks.py holds dequantize() to `gguf.quants.dequantize`):

* IQ2_XXS / IQ2_XS / IQ2_S: scale d * (0.5 + s) * 0.25 (s 4 bits, a scale per 32 / 16 / 16
  weights), code = grid value (8, 25 or 43) with its sign.
* IQ3_XXS: d * (0.5 + s) * 0.5 per 32, code +-4..62; IQ3_S: d * (1 + 2s) per 32, code +-1..15.
* IQ1_S / IQ1_M: llama.cpp's d * (2s + 1) * (g + delta), g in {-1, 0, 1}, delta +-1/8 (per 32 /
  8 weights), as scale d * (2s + 1) / 8 (per 32 / 16) and code 8g + 8 delta in {+-1, +-7, +-9}.
"""

from __future__ import annotations

import functools

import torch

LATTICE = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")


@functools.cache
def _tables() -> dict[str, torch.Tensor]:
    """The grids as int8 [entries, width] and the 128-entry sign table, from the `gguf` package."""
    try:
        from gguf import quants
    except ImportError as e:
        raise ValueError(f"the IQ1/IQ2/IQ3 types need the `gguf` package's grids: {e}") from None
    out = {}
    for name in LATTICE:
        cls = getattr(quants, name, None)
        if cls is None or not hasattr(cls, "init_grid"):
            raise ValueError(f"the installed `gguf` package has no {name} grid; pip install -U gguf")
        cls.init_grid()
        grid = torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy())
        out[name] = grid.round().to(torch.int8) if name.startswith("IQ1") else grid.to(torch.int8)
    out["ksigns"] = torch.frombuffer(bytearray(quants.IQ2_XXS.ksigns), dtype=torch.uint8)
    return out


@functools.cache
def _table(name: str, device: torch.device) -> torch.Tensor:
    """Table `name` on `device`, copied there once: a dequantisation inside a CUDA graph's
    capture (an embedding lookup of decode) then reads nothing from the host, which is refused
    there."""
    return _tables()[name].to(device)


def _grid(name: str, index: torch.Tensor) -> torch.Tensor:
    """[n, e] indices -> [n, e * width] int8 grid values."""
    return _table(name, index.device)[index.long()].reshape(index.shape[0], -1)


def f16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _u32(b: torch.Tensor) -> torch.Tensor:
    """[n, 4k] bytes -> [n, k] int64: little-endian uint32s."""
    w = b.to(torch.int64).reshape(b.shape[0], -1, 4)
    return w[..., 0] | w[..., 1] << 8 | w[..., 2] << 16 | w[..., 3] << 24


def _u16(b: torch.Tensor) -> torch.Tensor:
    w = b.to(torch.int64).reshape(b.shape[0], -1, 2)
    return w[..., 0] | w[..., 1] << 8


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 8k] of 0/1: bit i of byte j at 8j + i."""
    shift = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b[:, :, None] >> shift) & 1).reshape(b.shape[0], -1)


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """[n, k] bytes -> [n, 2k]: the low nibble of each byte, then its high one."""
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(b.shape[0], -1)


def _signed(values: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    return torch.where(negative.bool(), -values, values)


def _sign_bits(index: torch.Tensor) -> torch.Tensor:
    """[n, e] 7-bit indices into the sign table -> [n, 8e] of 0/1 (1: negative)."""
    return _bits(_table("ksigns", index.device)[index.long()])


def _iq2_xxs(b):
    n, d = b.shape[0], f16(b[:, :2])
    words = _u32(b[:, 2:66]).reshape(n, 8, 2)  # a group of 32: 4 grid bytes, then signs and scale
    index = words[..., 0:1] >> torch.arange(0, 32, 8, device=b.device) & 0xFF
    signs = words[..., 1:2] >> torch.arange(0, 28, 7, device=b.device) & 0x7F
    code = _signed(_grid("IQ2_XXS", index.reshape(n, 32)), _sign_bits(signs.reshape(n, 32)))
    return d * (0.5 + (words[..., 1] >> 28).float()) * 0.25, code


def _iq2_xs(b):
    d = f16(b[:, :2])
    entries = _u16(b[:, 2:66])  # 9 bits of grid index, 7 of sign index
    code = _signed(_grid("IQ2_XS", entries & 511), _sign_bits(entries >> 9))
    return d * (0.5 + _nibbles(b[:, 66:74]).float()) * 0.25, code


def _iq2_s(b):
    n, d = b.shape[0], f16(b[:, :2])
    high = (b[:, 66:74, None].to(torch.int64) >> torch.arange(0, 8, 2, device=b.device)) & 3
    index = b[:, 2:34].to(torch.int64) | high.reshape(n, 32) << 8
    code = _signed(_grid("IQ2_S", index), _bits(b[:, 34:66]))
    return d * (0.5 + _nibbles(b[:, 74:82]).float()) * 0.25, code


def _iq3_xxs(b):
    n, d = b.shape[0], f16(b[:, :2])
    words = _u32(b[:, 66:98])  # a group of 32: 4 sign indices, then the scale
    signs = words[:, :, None] >> torch.arange(0, 28, 7, device=b.device) & 0x7F
    code = _signed(_grid("IQ3_XXS", b[:, 2:66]), _sign_bits(signs.reshape(n, 32)))
    return d * (0.5 + (words >> 28).float()) * 0.5, code


def _iq3_s(b):
    d = f16(b[:, :2])
    index = b[:, 2:66].to(torch.int64) | _bits(b[:, 66:74]).to(torch.int64) << 8
    code = _signed(_grid("IQ3_S", index), _bits(b[:, 74:106]))
    return d * (1 + 2 * _nibbles(b[:, 106:110]).float()), code


def _iq1_codes(grid_values: torch.Tensor, negative_delta: torch.Tensor) -> torch.Tensor:
    """8g + 8 delta: g in {-1, 0, 1}, delta +1/8 (or -1/8 where negative_delta) of each weight."""
    return grid_values * 8 + torch.where(negative_delta.bool(), -1, 1).to(torch.int8)


def _iq1_s(b):
    n, d = b.shape[0], f16(b[:, :2])
    qh = _u16(b[:, 34:50])  # a group of 32: 4 x 3 index bits, the scale, the delta's sign
    high = qh[:, :, None] >> torch.arange(0, 12, 3, device=b.device) & 7
    index = b[:, 2:34].to(torch.int64) | high.reshape(n, 32) << 8
    code = _iq1_codes(_grid("IQ1_S", index), (qh >> 15).repeat_interleave(32, dim=1))
    return d * (2 * (qh >> 12 & 7) + 1).float() / 8, code


def iq1_m_d(b: torch.Tensor) -> torch.Tensor:
    """[n, 56] IQ1_M blocks -> the float16 d (its 4 nibbles are the scale words' top ones) as [n, 2] bytes."""
    words = _u16(b[:, 48:56])
    d = ((words >> 12) << torch.arange(0, 16, 4, device=b.device)).sum(dim=1)
    return torch.stack([d & 0xFF, d >> 8], dim=1).to(torch.uint8)


def _iq1_m(b):
    n = b.shape[0]
    d = f16(iq1_m_d(b))
    scales = _u16(b[:, 48:56])[:, :, None] >> torch.arange(0, 12, 3, device=b.device) & 7  # a 16 weights
    nib = _nibbles(b[:, 32:48]).to(torch.int64)  # an entry of 8: 3 index bits, the delta's sign
    index = b[:, :32].to(torch.int64) | (nib & 7) << 8
    code = _iq1_codes(_grid("IQ1_M", index), (nib >> 3).repeat_interleave(8, dim=1))
    return d * (2 * scales.reshape(n, 16) + 1).float() / 8, code


PARTS = {"IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s, "IQ3_XXS": _iq3_xxs, "IQ3_S": _iq3_s,
         "IQ1_S": _iq1_s, "IQ1_M": _iq1_m}


def parts(name: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, block bytes] blocks of `name` -> (scale float32 [n, groups], code int8 [n, 256])."""
    return PARTS[name](blocks)


def dequantize(name: str, blocks: torch.Tensor) -> torch.Tensor:
    scale, code = parts(name, blocks)
    n, groups = scale.shape
    return (scale[:, :, None] * code.reshape(n, groups, -1).float()).reshape(n, 256)
