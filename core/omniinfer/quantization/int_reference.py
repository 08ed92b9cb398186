"""The torch reference of the quantized products, with the Triton kernels' numerics.

What every platform can fall back to and what the kernels are tested against:

* weight-only: the weight dequantized in float32, ``(code - zero) * scale``, rounded once to the
  activation dtype, multiplied with float32 accumulation, rounded once to the output;
* int8 W8A8: activations quantized per row (``scale = max|row| / 127``, or a static scale;
  ``round`` half to even, clamped to [-128, 127]), the int8 x int8 product exact, scaled by
  the row's and the output channel's scale in float32;
* int8 W8A16: the int8 codes exact in the activation dtype, the float32 sum scaled per output
  channel (the weight itself is never rounded).

This dequantizes the whole weight on every call: a fallback, not a fast path.
"""

from __future__ import annotations

import torch

from omniinfer.quantization.int_layouts import Int8Weight, PackedIntWeight


def wn_linear_reference(x: torch.Tensor, weight: PackedIntWeight,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    w = weight.dequantize().to(x.dtype).float()
    out = x.float() @ w.t()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def quantize_int8_rows_reference(x: torch.Tensor, static_scale: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes, float32 scale per row) of x [..., K] flattened to rows."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    if static_scale is None:
        scale = x2.abs().amax(1).clamp(min=1e-10) / 127
    else:
        scale = static_scale.float().reshape(1).expand(x2.shape[0])
    q = torch.clamp(torch.round(x2 / scale[:, None]), -128, 127).to(torch.int8)
    return q, scale.contiguous()


def int8_linear_reference(x: torch.Tensor, weight: Int8Weight,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.quantize_activations:
        q, scale = quantize_int8_rows_reference(x, weight.input_scale)
        # int8 products summed exactly (float64 holds every int32 sum of K < 2**17 products)
        out = (q.double() @ weight.weight.double().t()).float() * scale[:, None]
    else:
        out = x.reshape(-1, x.shape[-1]).float() @ weight.weight.float().t()
    out = out * weight.weight_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], -1)
