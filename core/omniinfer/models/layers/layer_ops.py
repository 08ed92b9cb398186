"""The elementwise pieces of a decoder layer (RMS norm, rotary embedding, SiLU-and-multiply), and
the greedy sampler's argmax over the logits, as one swappable object.

The core's `LayerOps` are torch ops. A platform's model runner may install its own subclass
after loading (`ModelRunner.layer_ops`): fused kernels that make one pass over memory where
torch makes several. An override keeps each method's contract and may call `super()` for cases
it does not handle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniinfer.sampling.sampler import greedy_tokens


class LayerOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """RMSNorm in float32 (as transformers); with `residual`, adds it first and returns
        (normed, x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def rotary(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """GPT-NeoX ("rotate half") rotary embedding. query [T, heads * head], key
        [T, kv_heads * head]; cos/sin [max_position, rotary_dim / 2] float32: the first
        rotary_dim features of each head rotate (rotary_dim < head: a partial rotary), the rest
        pass. Returns the rotated query and key (an override may rotate them in place and return
        its inputs)."""
        cos = cos[positions].to(query.dtype).unsqueeze(1)
        sin = sin[positions].to(query.dtype).unsqueeze(1)
        return _rotate(query, cos, sin, head_size), _rotate(key, cos, sin, head_size)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2 * I] -> silu(x[:, :I]) * x[:, I:]"""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """The index of the first maximum of each row of [rows, vocab] logits, as torch.argmax
        (a NaN counts as the maximum): the sampler's greedy tokens, [rows] int64 on the logits'
        device."""
        return greedy_tokens(logits)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(shape[0], -1, head_size)
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    return out.view(shape)


TORCH_LAYER_OPS = LayerOps()


def install_layer_ops(model: nn.Module, ops: LayerOps) -> int:
    """Give `ops` to every module that uses layer ops; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(getattr(module, "ops", None), LayerOps):
            module.ops = ops
            count += 1
    return count


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.ops = TORCH_LAYER_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
