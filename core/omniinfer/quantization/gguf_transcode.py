"""GGUF blocks rewritten, exactly, as another type a platform runs: Q3_K as Q6_K, IQ4_NL as Q8_0.

* Q3_K's weight is ``(d * (s - 32)) * q`` with a 6-bit scale s per 16 weights and q in [-4, 3];
  Q6_K's is ``(d * c) * (u - 32)`` with an int8 scale c per 16 weights and a 6-bit u. So c = s - 32
  and u = q + 32, with the same float16 d, are Q6_K blocks that dequantise to the same float32
  numbers in the same order (tests/test_gguf_transcode.py holds them to `gguf.quants.dequantize`).
* IQ4_NL's weight is ``d * IQ4_VALUES[code]``, values in [-127, 113]: Q8_0 blocks with the same d
  and those values as their int8 codes.

Both take more bytes (Q3_K 110 -> 210 a block of 256, IQ4_NL 18 -> 34 a block of 32): a platform
uses this to run a type it has no kernel for at the speed of the one it has (the CPU plugin: a
Q3_K_M file's Q3_K tensors, and the IQ4_NL a narrow model's Q3_K_M file falls back to)."""

from __future__ import annotations

import torch

from omniinfer.quantization.gguf_blocks import BY_NAME, IQ4_VALUES, q3_k_parts

EXACTLY_AS = {"Q3_K": "Q6_K", "IQ4_NL": "Q8_0"}
SLICE_BLOCKS = 1 << 16  # blocks rewritten at once (bounds the temporaries: ~30 MB for Q3_K)


def _q3_k_as_q6_k(b: torch.Tensor) -> torch.Tensor:
    """[n, 110] Q3_K blocks -> [n, 210] Q6_K blocks."""
    n = b.shape[0]
    d, scales, q = q3_k_parts(b)
    u = (q + 32).to(torch.uint8).reshape(n, 2, 4, 32)  # [block, half, 32-run, weight]
    low, high = u & 0x0F, u >> 4
    ql = low[:, :, 0:2].reshape(n, 2, 64) | (low[:, :, 2:4].reshape(n, 2, 64) << 4)  # u, u + 64
    shift = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    qh = (high << shift).sum(dim=2, dtype=torch.uint8)  # [n, 2, 32]: the four runs' bits 4-5
    return torch.cat([ql.reshape(n, 128), qh.reshape(n, 64), scales.view(torch.uint8), d], dim=1)


def _iq4_nl_as_q8_0(b: torch.Tensor) -> torch.Tensor:
    """[n, 18] IQ4_NL blocks -> [n, 34] Q8_0 blocks."""
    qs = b[:, 2:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=1).long()
    values = torch.tensor(IQ4_VALUES, dtype=torch.int8, device=b.device)[codes]
    return torch.cat([b[:, :2], values.view(torch.uint8)], dim=1)


_REWRITE = {"Q3_K": _q3_k_as_q6_k, "IQ4_NL": _iq4_nl_as_q8_0}


def transcode(type_name: str, data: torch.Tensor, cols: int) -> tuple[str, torch.Tensor]:
    """(EXACTLY_AS[type_name], its blocks) for `type_name` blocks [rows, row bytes] of `cols`
    weights a row."""
    kind, target = BY_NAME[type_name], BY_NAME[EXACTLY_AS[type_name]]
    rows = data.shape[0]
    blocks = data.reshape(-1, kind.block_bytes)
    out = torch.empty(blocks.shape[0], target.block_bytes, dtype=torch.uint8, device=data.device)
    for i in range(0, blocks.shape[0], SLICE_BLOCKS):
        out[i:i + SLICE_BLOCKS] = _REWRITE[type_name](blocks[i:i + SLICE_BLOCKS])
    return target.name, out.reshape(rows, target.row_bytes(cols))
