from __future__ import annotations

import torch
from torch import nn

from omniinfer.models.layers.layer_ops import TORCH_LAYER_OPS


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as transformers does); with `residual`, adds it first and
    returns (normed, new residual). The arithmetic is `self.ops.rms_norm` (see layer_ops.py)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.ops = TORCH_LAYER_OPS

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1 and applied in float32 before
    the cast (`(x * rsqrt(mean(x^2) + eps) * (1 + w)).to(dtype)`, as transformers' Gemma 2/3);
    with `residual`, adds it first and returns (normed, new residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)
