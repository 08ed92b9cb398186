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
