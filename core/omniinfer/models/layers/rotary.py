"""Rotary position embedding (GPT-NeoX "rotate half" layout, as Hugging Face checkpoints use), with
every frequency scaling the supported families ship: `linear`, `dynamic` (NTK), `yarn`, `llama3`
and `longrope` (Phi-3's, also spelled `su`). Each is transformers' `modeling_rope_utils` formula.
`freq_factors` (omniinfer's: a GGUF file's `rope_freqs` tensor, as llama.cpp's converter writes
`llama3`) divides each frequency by its own factor, as llama.cpp's rope does.

A scaling only changes the cos/sin table, [positions, rotary_dim / 2] float32: row p is what the
token at position p is rotated by. `rotary_dim` is the head size, or less where a config has a
`partial_rotary_factor` (Phi-4-mini's 0.75): the first rotary_dim features of each head rotate
(in rotate-half pairs of their own), the rest pass through, and every frequency formula takes
rotary_dim as its dimension (transformers' and llama.cpp's `n_rot` alike). Where transformers recomputes the frequencies from the batch's
longest sequence (`dynamic`, `longrope`), row p uses what it computes for a sequence of p + 1
tokens, which is what it uses for that token while decoding one token at a time.
"""

from __future__ import annotations

import json
import math
import weakref

import torch
from torch import nn

from omniinfer.models.layers.layer_ops import TORCH_LAYER_OPS

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope", "freq_factors")


def _base_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _need(scaling: dict, key: str):
    if scaling.get(key) is None:
        raise ValueError(f"rope scaling {scaling['rope_type']!r} needs {key!r}; got {scaling}")
    return scaling[key]


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor = float(_need(s, "factor"))
    low, high = float(_need(s, "low_freq_factor")), float(_need(s, "high_freq_factor"))
    old_len = float(_need(s, "original_max_position_embeddings"))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: dict, max_position: int) -> tuple[torch.Tensor, float]:
    original = int(_need(s, "original_max_position_embeddings"))
    factor = s.get("factor")
    factor = float(factor) if factor is not None else max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope(dim: int, theta: float, s: dict, max_position: int, num_positions: int):
    """(per-position inv_freq [num_positions, dim / 2], attention factor)."""
    original = int(_need(s, "original_max_position_embeddings"))
    factor = s.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = torch.tensor(_need(s, key), dtype=torch.float32)
        if values.numel() != dim // 2:
            raise ValueError(f"rope scaling 'longrope': {key} has {values.numel()} values; the "
                             f"rotary dimension {dim} needs {dim // 2}")
        factors[key] = 1.0 / (values * theta ** shape)
    is_long = (torch.arange(num_positions) + 1 > original)[:, None]
    return torch.where(is_long, factors["long_factor"], factors["short_factor"]), float(attention)


def _dynamic(dim: int, theta: float, s: dict, max_position: int, num_positions: int) -> torch.Tensor:
    factor = float(_need(s, "factor"))
    seq_len = torch.clamp(torch.arange(num_positions, dtype=torch.float64) + 1, min=max_position)
    base = theta * ((factor * seq_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).double() / dim
    return (1.0 / base[:, None] ** exponent[None, :]).float()


def rotary_dim(cfg: dict, head_size: int) -> int:
    """The features of each head the rotary embedding turns: head_size * partial_rotary_factor
    (truncated, as transformers does, but not by a rounding error: a GGUF file's 72 of 96 stored
    as 72 / 96), from the config or its rope parameters."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    try:
        dim = int(head_size * float(factor) + 1e-6)
    except (TypeError, ValueError):
        dim = 0
    if not 0 < dim <= head_size or dim % 2:
        raise ValueError(f"partial_rotary_factor={factor!r} turns {dim} of each {head_size}-wide head; "
                         "expected a factor in (0, 1] that makes an even number of features")
    return dim


def rope_tables(head_size: int, num_positions: int, theta: float, scaling: dict | None,
                max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [num_positions, head_size / 2] float32, for one scaling (None: plain).
    `head_size`: the rotary dimension (rotary_dim(); the head size unless the rotary is partial).
    `max_position` is the config's `max_position_embeddings` (default: num_positions)."""
    max_position = max_position or num_positions
    kind = (scaling or {}).get("rope_type", "default")
    kind = "longrope" if kind == "su" else kind
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if scaling and float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor={scaling['partial_rotary_factor']} in a scaling: pass "
                         "the rotary dimension instead (rotary_dim())")
    t = torch.arange(num_positions, dtype=torch.float32)
    attention = 1.0
    inv_freq = _base_inv_freq(head_size, theta)
    if kind == "linear":
        inv_freq = inv_freq / float(_need(scaling, "factor"))
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "freq_factors":
        factors = torch.tensor(_need(scaling, "factors"), dtype=torch.float64)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope scaling 'freq_factors' has {factors.numel()} factors; a head of "
                             f"{head_size} has {inv_freq.numel()} rotary frequencies")
        inv_freq = (inv_freq.double() / factors).float()
    elif kind == "yarn":
        inv_freq, attention = _yarn(head_size, theta, scaling, max_position)
    if kind in ("dynamic", "longrope"):
        if kind == "dynamic":
            per_position = _dynamic(head_size, theta, scaling, max_position, num_positions)
        else:
            per_position, attention = _longrope(head_size, theta, scaling, max_position, num_positions)
        freqs = t[:, None] * per_position
    else:
        freqs = torch.outer(t, inv_freq)
    return freqs.cos() * attention, freqs.sin() * attention


class _Tables:
    __slots__ = ("cos", "sin", "__weakref__")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin


_SHARED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_rope_tables(head_size: int, num_positions: int, theta: float, scaling: dict | None,
                       max_position: int | None = None) -> _Tables:
    """rope_tables, one pair for all the layers (and models) that ask for the same ones while any
    holds them: every layer of a model has the same tables (24 copies were 12 MiB for the medium
    model at 2048 positions). Read-only: nothing writes into them."""
    key = (head_size, num_positions, float(theta), json.dumps(scaling, sort_keys=True, default=str), max_position,
           str(torch.get_default_device()))  # (a model built under a device context: made there)
    tables = _SHARED.get(key)
    if tables is None:
        tables = _Tables(*rope_tables(head_size, num_positions, theta, scaling, max_position))
        _SHARED[key] = tables
    return tables


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, theta: float, scaling: dict | None,
                 num_positions: int | None = None, rotary_dim: int | None = None):
        """`max_position`: the config's max_position_embeddings (what the scalings are computed
        from); `num_positions`: rows of the table, the positions a token can have — the engine's
        max_model_len (default max_position). Row p does not depend on how many rows there are,
        so a model served at 2,048 tokens holds 2,048 rows, not the 32,768 (8 MiB at head size
        64) or 1,010,000 (0.5 GiB at 128) its config allows. `rotary_dim`: the features of each
        head that turn (default: all)."""
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim or head_size
        self._tables = shared_rope_tables(self.rotary_dim, num_positions or max_position, theta, scaling,
                                          max_position)
        # [positions, rotary_dim / 2] each; kept in float32, cast per call to the model dtype
        self.register_buffer("cos", self._tables.cos, persistent=False)
        self.register_buffer("sin", self._tables.sin, persistent=False)
        self.ops = TORCH_LAYER_OPS

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """query [T, heads * head], key [T, kv_heads * head] -> rotated, same shapes
        (`self.ops.rotary`, see layer_ops.py)."""
        return self.ops.rotary(positions, query, key, self.cos, self.sin, self.head_size)
