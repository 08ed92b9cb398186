"""GGUF blocks rewritten as another type a platform runs: exactly (Q3_K, IQ3_XXS, IQ3_S, IQ1_S and
IQ1_M as Q6_K, IQ4_NL as Q8_0), or as near as float16 and int8 allow (IQ4_XS, Q2_K and IQ2_XXS,
IQ2_XS, IQ2_S as Q8_0).

* Q3_K's weight is ``(d * (s - 32)) * q`` with a 6-bit scale s per 16 weights and q in [-4, 3];
  Q6_K's is ``(d * c) * (u - 32)`` with an int8 scale c per 16 weights and a 6-bit u. So c = s - 32
  and u = q + 32, with the same float16 d, are Q6_K blocks that dequantise to the same float32
  numbers in the same order (tests/test_gguf_transcode.py holds them to `gguf.quants.dequantize`).
* IQ4_NL's weight is ``d * IQ4_VALUES[code]``, values in [-127, 113]: Q8_0 blocks with the same d
  and those values as their int8 codes.
* IQ4_XS's is ``(d * (s - 32)) * IQ4_VALUES[code]`` per 32 weights: Q8_0 blocks whose float16
  scale is ``d * (s - 32)`` rounded to float16 (a product float16 cannot always hold: each weight
  moves by at most 2**-11 of itself, 0.05%, where the 4-bit codes' own rounding is ~8%; by up to
  2**-8 where the scale is below float16's normal range; a tensor with a scale that would move
  more, or overflow, is refused), the values their codes.
* Q2_K's is ``(d * a) * q - dmin * b`` per 16 weights, q in [0, 3]: no type here holds two
  16-weight groups' minimums in one block, so each 32 weights are requantised to Q8_0: the scale
  the largest weight / 127, rounded up to float16, codes rounded to nearest; each weight moves by
  at most half a step, 1/254 of its block's largest (0.4%, where Q2_K's own error is ~30%).

* The lattice types (quantization/gguf_iq.py: weight = scale * code, a scale per 16 or 32
  weights): IQ3_XXS, IQ3_S, IQ1_S and IQ1_M exactly as Q6_K, whose weight is (d * c) * (u - 32):
  d = the type's float16 d over 2 (IQ3_XXS, codes +-4..62 all even: halved), 1 (IQ3_S: +-1..15) or
  8 (IQ1: +-1..9), c = 2s + 1 of the scale's 4- or 3-bit s. Exact where d over 2 or 8 is a normal
  float16 (d at least 2**-13 or 2**-11); below that a subnormal, within 2**-8 of itself (a d that
  would move more is refused). IQ2_XXS (codes up to +-43, a scale a 32 weights) as Q8_0 as
  IQ4_XS is: its scale rounded to float16, its codes as they are; IQ2_XS and IQ2_S (a scale a 16
  weights: two in a Q8_0 block) requantised to Q8_0 as Q2_K is.

Each takes more bytes (Q3_K 110 -> 210 a block of 256, IQ4_XS 136 -> 272, Q2_K 84 -> 272, IQ4_NL
18 -> 34 a block of 32; IQ3 98 / 110 and IQ1 50 / 56 -> 210, IQ2 66-82 -> 272: 2-5x): a platform
uses this to run a type it has no kernel for at the speed of the one it has, instead of the
reference (~140x slower on the CPU). The CPU plugin does so for Q3_K, IQ4_NL, IQ4_XS and Q2_K with
float activations (with int8 activations, its default, it runs them on the file's own bytes), and
for the lattice types always; the Triton kernels for the lattice types."""

from __future__ import annotations

import functools

import torch

from omniinfer.quantization import gguf_iq
from omniinfer.quantization.gguf_blocks import (
    BY_NAME,
    dequantize,
    iq4_values,
    iq4_xs_scales,
    q3_k_parts,
)

EXACTLY_AS = {"Q3_K": "Q6_K", "IQ4_NL": "Q8_0", "IQ3_XXS": "Q6_K", "IQ3_S": "Q6_K", "IQ1_S": "Q6_K",
              "IQ1_M": "Q6_K"}
NEARLY_AS = {"IQ4_XS": "Q8_0", "Q2_K": "Q8_0", "IQ2_XXS": "Q8_0", "IQ2_XS": "Q8_0", "IQ2_S": "Q8_0"}  # (the bounds above)
REWRITES = {**EXACTLY_AS, **NEARLY_AS}
LATTICE_AS = {k: v for k, v in REWRITES.items() if k in gguf_iq.LATTICE}  # (no kernel decodes them: always)
MAX_SCALE_MOVE = 2.0 ** -8  # IQ4_XS: the most a scale may move, relative (2**-11 if normal)
SLICE_BLOCKS = 1 << 16  # blocks rewritten at once (bounds the temporaries: ~30 MB for Q3_K)


def _q3_k_as_q6_k(b: torch.Tensor) -> torch.Tensor:
    """[n, 110] Q3_K blocks -> [n, 210] Q6_K blocks."""
    return _q6_k(*q3_k_parts(b))


def _q6_k(d: torch.Tensor, scales: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks [n, 210] of d (float16 as [n, 2] bytes), int8 scales [n, 16] (one a 16 weights)
    and int8 codes [n, 256] in [-32, 31]."""
    n = q.shape[0]
    u = (q + 32).to(torch.uint8).reshape(n, 2, 4, 32)  # [block, half, 32-run, weight]
    low, high = u & 0x0F, u >> 4
    ql = low[:, :, 0:2].reshape(n, 2, 64) | (low[:, :, 2:4].reshape(n, 2, 64) << 4)  # u, u + 64
    shift = torch.arange(0, 8, 2, dtype=torch.uint8, device=q.device).reshape(1, 1, 4, 1)
    qh = (high << shift).sum(dim=2, dtype=torch.uint8)  # [n, 2, 32]: the four runs' bits 4-5
    return torch.cat([ql.reshape(n, 128), qh.reshape(n, 64), scales.view(torch.uint8), d], dim=1)


def _iq4_nl_as_q8_0(b: torch.Tensor) -> torch.Tensor:
    """[n, 18] IQ4_NL blocks -> [n, 34] Q8_0 blocks."""
    return torch.cat([b[:, :2], iq4_values(b[:, 2:]).view(torch.uint8)], dim=1)


def _q8_0(scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """float16 scales [m] and int8 codes [m, 32] -> [m, 34] Q8_0 blocks."""
    return torch.cat([scale.reshape(-1, 1).view(torch.uint8), codes.view(torch.uint8)], dim=1)


def _iq4_xs_as_q8_0(b: torch.Tensor) -> torch.Tensor:
    """[n, 136] IQ4_XS blocks -> [8n, 34] Q8_0 blocks."""
    n = b.shape[0]
    scale = iq4_xs_scales(b).reshape(-1)  # float32 d * (s - 32), exact
    return _q8_0(_half_scale("IQ4_XS", scale), iq4_values(b[:, 8:].reshape(n * 8, 16)))


def _iq2_xxs_as_q8_0(b: torch.Tensor) -> torch.Tensor:
    """[n, 66] IQ2_XXS blocks -> [8n, 34] Q8_0 blocks: its scale a 32 weights rounded to float16,
    its codes (+-8, 25, 43) as they are."""
    scale, code = gguf_iq.parts("IQ2_XXS", b)
    return _q8_0(_half_scale("IQ2_XXS", scale.reshape(-1)), code.reshape(-1, 32))


def _half_scale(name: str, scale: torch.Tensor) -> torch.Tensor:
    """float32 sub-block scales as float16, each within MAX_SCALE_MOVE of itself (ValueError if not)."""
    half = scale.to(torch.float16)
    moved = (half.float() - scale).abs() > MAX_SCALE_MOVE * scale.abs()  # (inf - x: inf, moved)
    if bool(moved.any()):
        bad = float(scale[moved][0])
        raise ValueError(f"an {name} sub-block scale of {bad:g} is not a float16 within "
                         f"{MAX_SCALE_MOVE:g} of itself (float16 holds 6.1e-05 to 65504 to 2**-11; "
                         "smaller ones to 6e-08): as a Q8_0 scale it would move its weights more")
    return half


# the lattice types exactly as Q6_K: what d is divided by, and each code
_Q6_K_D = {"IQ3_XXS": 2, "IQ3_S": 1, "IQ1_S": 8, "IQ1_M": 8}


def _lattice_as_q6_k(name: str, b: torch.Tensor) -> torch.Tensor:
    """[n, block bytes] IQ3_XXS / IQ3_S / IQ1_S / IQ1_M blocks -> [n, 210] Q6_K blocks."""
    n = b.shape[0]
    scale, code = gguf_iq.parts(name, b)  # scale = d * c / _Q6_K_D (IQ3_XXS: d * c / 4, code even)
    d = gguf_iq.f16(gguf_iq.iq1_m_d(b) if name == "IQ1_M" else b[:, :2])
    divisor = _Q6_K_D[name]
    c = scale * (4 if name == "IQ3_XXS" else divisor) / d  # 2s + 1, exactly (d * c: exact products)
    c = torch.where(d == 0, 1.0, c).round().to(torch.int8)
    half = (d / divisor).to(torch.float16)  # (exact down to d = 2**-14 * divisor; below, a subnormal)
    if bool(((half.float() * divisor - d).abs() > MAX_SCALE_MOVE * d.abs()).any()):
        raise ValueError(f"an {name} block's d is too small for a float16 d / {divisor} within "
                         f"{MAX_SCALE_MOVE:g} of itself: as Q6_K it would move its weights more")
    if name == "IQ3_XXS":
        code = code // 2  # (+-4..62, even)
    scales = c.repeat_interleave(16 // c.shape[1], dim=1)  # (Q6_K: a scale a 16 weights)
    return _q6_k(half.reshape(n, 1).view(torch.uint8), scales, code)


def _requantised_as_q8_0(name: str, b: torch.Tensor) -> torch.Tensor:
    """[n, block bytes] blocks of 256 -> [8n, 34] Q8_0 blocks, requantised as Q2_K's are."""
    w = dequantize(b, BY_NAME[name], 256).reshape(-1, 32)
    step = w.abs().amax(dim=1) / 127
    if bool((step > torch.finfo(torch.float16).max).any()):
        raise ValueError(f"a {name} block's weights reach {float(w.abs().max()):g}: a Q8_0 step for "
                         "them is beyond float16")
    half = step.to(torch.float16)
    low = half.float() < step  # rounded down: one float16 up, so no code passes 127
    half[low] = (half[low].view(torch.int16) + 1).view(torch.float16)
    codes = torch.round(w / torch.where(half == 0, 1.0, half.float())[:, None])
    return _q8_0(half, codes.clamp(-127, 127).to(torch.int8))


_REWRITE = {"Q3_K": _q3_k_as_q6_k, "IQ4_NL": _iq4_nl_as_q8_0, "IQ4_XS": _iq4_xs_as_q8_0,
            "Q2_K": functools.partial(_requantised_as_q8_0, "Q2_K"),
            **{name: functools.partial(_lattice_as_q6_k, name) for name in _Q6_K_D},
            "IQ2_XXS": _iq2_xxs_as_q8_0,
            **{name: functools.partial(_requantised_as_q8_0, name) for name in ("IQ2_XS", "IQ2_S")}}


def transcode(type_name: str, data: torch.Tensor, cols: int) -> tuple[str, torch.Tensor]:
    """(REWRITES[type_name], its blocks) for `type_name` blocks [rows, row bytes] of `cols`
    weights a row; ValueError where a near rewrite would not keep its bound."""
    kind, target = BY_NAME[type_name], BY_NAME[REWRITES[type_name]]
    rows = data.shape[0]
    blocks = data.reshape(-1, kind.block_bytes)
    per = kind.block // target.block  # target blocks a block
    out = torch.empty(blocks.shape[0] * per, target.block_bytes, dtype=torch.uint8, device=data.device)
    for i in range(0, blocks.shape[0], SLICE_BLOCKS):
        part = _REWRITE[type_name](blocks[i:i + SLICE_BLOCKS])
        out[i * per:i * per + part.shape[0]] = part
    return target.name, out.reshape(rows, target.row_bytes(cols))
