"""GGUF's tensor types: block sizes and bytes, and a torch dequantisation of each (the reference
every platform can fall back to; tests/test_gguf_blocks.py holds it to `gguf.quants.dequantize`,
bit for bit).

A quantised row of K weights is K / B blocks of B weights, each block a fixed number of bytes
(B = 32 for the classic types, 256 for the K-quants), stored one row after another: a tensor of
[rows, K] weights is [rows, K / B * block_bytes] bytes. Rows are independent, so a range of rows
is a range of byte rows; a range of columns is a range of blocks, so a split along K must fall on
a block boundary. Each block's scales are float16; the arithmetic below is float32 in the same
order as the reference (for Q6_K that order decides the last bit: (d * scale) * q), on the
device the blocks are on (this is the GPU platforms' fallback too).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from omniinfer.quantization import gguf_iq


@dataclass(frozen=True, slots=True)
class BlockType:
    name: str  # as GGUF spells it ("Q4_K")
    code: int  # GGMLQuantizationType's value
    block: int  # weights a block
    block_bytes: int

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.block_bytes


TYPES = {t.code: t for t in (
    BlockType("F32", 0, 1, 4), BlockType("F16", 1, 1, 2), BlockType("BF16", 30, 1, 2),
    BlockType("Q4_0", 2, 32, 18), BlockType("Q4_1", 3, 32, 20), BlockType("Q5_0", 6, 32, 22),
    BlockType("Q5_1", 7, 32, 24), BlockType("Q8_0", 8, 32, 34), BlockType("Q4_K", 12, 256, 144),
    BlockType("Q5_K", 13, 256, 176), BlockType("Q6_K", 14, 256, 210), BlockType("Q2_K", 10, 256, 84),
    BlockType("Q3_K", 11, 256, 110), BlockType("IQ4_NL", 20, 32, 18), BlockType("IQ4_XS", 23, 256, 136),
    # llama.cpp's lattice types (quantization/gguf_iq.py)
    BlockType("IQ2_XXS", 16, 256, 66), BlockType("IQ2_XS", 17, 256, 74), BlockType("IQ2_S", 22, 256, 82),
    BlockType("IQ3_XXS", 18, 256, 98), BlockType("IQ3_S", 21, 256, 110), BlockType("IQ1_S", 19, 256, 50),
    BlockType("IQ1_M", 29, 256, 56),
)}
# IQ4_NL / IQ4_XS: a 4-bit code indexes these int8 values (llama.cpp's kvalues_iq4nl)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
BY_NAME = {t.name: t for t in TYPES.values()}
QUANTIZED = tuple(t.name for t in TYPES.values() if t.block > 1)  # the block types (not F32/F16/BF16)


def type_of(code: int, tensor: str = "") -> BlockType:
    if code not in TYPES:
        where = f"tensor {tensor!r} has " if tensor else ""
        raise ValueError(f"{where}GGUF tensor type {code} ({_ggml_name(code)}), which omniinfer does not "
                         f"load; supported: {', '.join(t.name for t in TYPES.values())}")
    return TYPES[code]


def _ggml_name(code: int) -> str:
    try:
        import gguf

        return gguf.GGMLQuantizationType(code).name
    except (ImportError, ValueError):
        return "unknown"


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes -> float32 (the float16 they hold)."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes -> [n, 32]: the low nibbles, then the high ones (the classic types' order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes (a little-endian uint32) -> [n, 32]: bit j of it, as 0 or 16."""
    word = qh.to(torch.int64)
    word = word[:, 0] | word[:, 1] << 8 | word[:, 2] << 16 | word[:, 3] << 24
    return ((word[:, None] >> torch.arange(32, device=qh.device)) & 1).to(torch.uint8) << 4


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins for 8 sub-blocks -> ([n, 8], [n, 8])."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, :2])


def _q4_0(b):
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def _q4_1(b):
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_0(b):
    q = (_nibbles(b[:, 6:]) | _high_bits(b[:, 2:6])).to(torch.int8) - 16
    return _f16(b[:, :2]) * q.float()


def _q5_1(b):
    q = _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8])
    return _f16(b[:, :2]) * q.float() + _f16(b[:, 2:4])


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 128] -> [n, 8, 32]: each 32-byte run's low nibbles, then its high ones."""
    runs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    q = _k_nibbles(b[:, 16:144]).float()
    return ((d * sc.float())[:, :, None] * q - (dmin * mn.float())[:, :, None]).reshape(n, 256)


def _q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]
    bit = torch.arange(8, dtype=torch.uint8, device=b.device)
    high = ((qh[:, None, :] >> bit[None, :, None]) & 1) << 4  # [n, 8, 32]
    q = (_k_nibbles(b[:, 48:176]) | high).float()
    return ((d * sc.float())[:, :, None] * q - (dmin * mn.float())[:, :, None]).reshape(n, 256)


def _q6_k(b):
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    low = ql.reshape(n, 2, 1, 64)
    low = torch.cat([low & 0x0F, low >> 4], dim=2).reshape(n, 8, 32)
    shift = torch.arange(0, 8, 2, dtype=torch.uint8, device=b.device)
    high = qh.reshape(n, 2, 1, 32) >> shift.reshape(1, 1, 4, 1)
    high = (high & 0x03).reshape(n, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).float().reshape(n, 16, 16)
    scale = (d * scales.contiguous().view(torch.int8).float()).reshape(n, 16, 1)
    return (scale * q).reshape(n, 256)


def _crumbs(qs: torch.Tensor, shifts: int = 4) -> torch.Tensor:
    """[n, 64] bytes -> [n, 256] 2-bit codes: each 32-byte run's bits 0-1 for 32 weights, then
    bits 2-3, 4-5 and 6-7 (Q2_K / Q3_K; `shifts` 2-bit fields a byte)."""
    shift = torch.arange(0, 2 * shifts, 2, dtype=torch.uint8, device=qs.device).reshape(1, 1, shifts, 1)
    return ((qs.reshape(qs.shape[0], -1, 1, 32) >> shift) & 3).reshape(qs.shape[0], -1)


def _q2_k(b):
    n = b.shape[0]
    scales, d, dmin = b[:, :16], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    return (dl * _crumbs(b[:, 16:80]).float().reshape(n, 16, 16) - ml).reshape(n, 256)


def q3_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, 110] Q3_K blocks -> (d's 2 bytes [n, 2], the 16 scales s - 32 as int8 [n, 16], the
    codes in [-4, 3] as int8 [n, 256]): weight j is (d * scale[j // 16]) * code[j]."""
    n = b.shape[0]
    hmask, scales = b[:, :32], b[:, 96:108]
    dev = b.device
    low = scales[:, :8].reshape(n, 1, 8) >> torch.arange(0, 8, 4, dtype=torch.uint8, device=dev).reshape(1, 2, 1)
    high = scales[:, 8:].reshape(n, 1, 4) >> torch.arange(0, 8, 2, dtype=torch.uint8,
                                                           device=dev).reshape(1, 4, 1)
    sc = ((low.reshape(n, 16) & 0x0F) | ((high.reshape(n, 16) & 0x03) << 4)).to(torch.int8) - 32
    bit = torch.arange(8, dtype=torch.uint8, device=dev).reshape(1, 8, 1)
    hbit = ((hmask.reshape(n, 1, 32) >> bit) & 1).reshape(n, 256)  # 1: no offset; 0: minus 4
    return b[:, 108:110], sc, _crumbs(b[:, 32:96]).to(torch.int8) - ((hbit ^ 1) << 2).to(torch.int8)


def _q3_k(b):
    n = b.shape[0]
    d, sc, q = q3_k_parts(b)
    return ((_f16(d) * sc.float()).reshape(n, 16, 1) * q.float().reshape(n, 16, 16)).reshape(n, 256)


def iq4_values(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] bytes of IQ4 nibbles -> [n, 32] int8: the IQ4_VALUES they index (the low nibbles,
    then the high ones)."""
    return iq4_table(qs.device)[_nibbles(qs).long()]


@functools.cache
def iq4_table(device: torch.device, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """IQ4_VALUES on `device`, copied there once (as gguf_iq's grids: a dequantisation, or the
    Triton kernel's launch, inside a CUDA graph's capture then reads nothing from the host)."""
    return torch.tensor(IQ4_VALUES, dtype=dtype, device=device)


def _iq4_nl(b):
    return _f16(b[:, :2]) * iq4_values(b[:, 2:]).float()


def iq4_xs_scales(b: torch.Tensor) -> torch.Tensor:
    """[n, 136] IQ4_XS blocks -> float32 [n, 8]: each 32 weights' d * (s - 32)."""
    n = b.shape[0]
    high = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32)  # (a little-endian uint16)
    low = b[:, 4:8].reshape(n, 4, 1) >> torch.arange(0, 8, 4, dtype=torch.uint8, device=b.device).reshape(1, 1, 2)
    shift = torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)
    ls = (low.reshape(n, 8) & 0x0F).to(torch.int32) | (((high >> shift) & 3) << 4)
    return _f16(b[:, :2]) * (ls - 32).float()


def _iq4_xs(b):
    n = b.shape[0]
    dl = iq4_xs_scales(b).reshape(n, 8, 1)
    return (dl * iq4_values(b[:, 8:].reshape(n * 8, 16)).float().reshape(n, 8, 32)).reshape(n, 256)


_BLOCKS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
           "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "Q2_K": _q2_k, "Q3_K": _q3_k,
           "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
           **{name: functools.partial(gguf_iq.dequantize, name) for name in gguf_iq.LATTICE}}


def dequantize(data: torch.Tensor, kind: BlockType, cols: int) -> torch.Tensor:
    """[rows, kind.row_bytes(cols)] uint8 -> [rows, cols] float32."""
    rows = data.shape[0]
    if kind.name == "F32":
        return data.contiguous().view(torch.float32).reshape(rows, cols)
    if kind.name == "F16":
        return data.contiguous().view(torch.float16).float().reshape(rows, cols)
    if kind.name == "BF16":
        return data.contiguous().view(torch.bfloat16).float().reshape(rows, cols)
    blocks = data.reshape(rows * (cols // kind.block), kind.block_bytes)
    return _BLOCKS[kind.name](blocks).reshape(rows, cols)
