"""`quantization="int8"`: a float checkpoint's linear weights quantised as they are loaded, per
output channel, symmetric: row r is `q[r] * scale[r]` with q in [-127, 127] (round to nearest
even) and scale = max |w[r]| / 127 in float32. The float weight is freed; the embedding and the
LM head stay float (as vLLM's int8 does)."""

from __future__ import annotations

import torch
from torch import nn

from omniinfer.models.layers.linear import LinearBase
from omniinfer.quantization.base import QuantPiece, QuantSlot, register_format

KIND = "int8"


def quantize(weight: torch.Tensor) -> QuantPiece:
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    q = torch.where(scale[:, None] > 0, w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None],
                    torch.zeros_like(w))
    q = torch.round(q).clamp_(-127, 127).to(torch.int8)
    return QuantPiece(KIND, tuple(weight.shape), {"q": q.contiguous(), "scale": scale.contiguous()})


def _dequantize(piece: QuantPiece) -> torch.Tensor:
    return piece.tensors["q"].float() * piece.tensors["scale"][:, None]


def _narrow(piece: QuantPiece, dim: int, start, length: int | None = None) -> QuantPiece:
    q, scale = piece.tensors["q"], piece.tensors["scale"]
    if dim == 0:
        rows = start if isinstance(start, torch.Tensor) else slice(start, start + length)
        q, scale = q[rows], scale[rows]
    else:
        q = q.narrow(1, start, length)
    return QuantPiece(KIND, tuple(q.shape), {"q": q.contiguous(), "scale": scale.contiguous()})


register_format(KIND, _dequantize, _narrow)


def quantize_model(model: nn.Module, quantize=quantize) -> int:
    """Every linear layer's loaded float weight -> a slot holding `quantize(weight)` (a QuantPiece;
    finished by loading.finish); the float weight goes. Returns how many."""
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, LinearBase) or module.weight.is_meta:
            continue
        slot = QuantSlot(tuple(module.weight.shape), f"{name}.weight")
        slot.copy_(quantize(module.weight))
        meta = nn.Parameter(torch.empty(module.weight.shape, dtype=module.weight.dtype, device="meta"),
                            requires_grad=False)
        meta.weight_loader = module.weight.weight_loader
        module.weight = meta  # the float copy goes
        module.qslot = slot
        count += 1
    return count
