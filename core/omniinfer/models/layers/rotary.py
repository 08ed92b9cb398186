"""Rotary position embedding (GPT-NeoX "rotate half" layout, as Llama checkpoints use),
with the `linear` and `llama3` frequency scalings."""

from __future__ import annotations

import math

import torch
from torch import nn

from omniinfer.models.layers.layer_ops import TORCH_LAYER_OPS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _inv_freq(head_size: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"rope scaling type {kind!r} is not supported; supported: "
                     f"{', '.join(SUPPORTED_ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_size = head_size
        inv_freq = _inv_freq(head_size, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # [max_position, head_size / 2] each; kept in float32, cast per call to the model dtype
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
        self.ops = TORCH_LAYER_OPS

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """query [T, heads * head], key [T, kv_heads * head] -> rotated, same shapes
        (`self.ops.rotary`, see layer_ops.py)."""
        return self.ops.rotary(positions, query, key, self.cos, self.sin, self.head_size)
