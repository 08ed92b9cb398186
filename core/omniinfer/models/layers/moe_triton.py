"""The Triton fused-MoE method (omniinfer.kernels.triton.fused_moe), and the model transform the
accelerator platforms (CUDA, ROCm, XPU) declare to install it where triton runs on the device.

Importing this module does not import triton; the kernel module is imported at the first call."""

from __future__ import annotations

import torch

from omniinfer.logger import init_logger
from omniinfer.models.layers.moe import MoEMethod
from omniinfer.models.transform import ModelTransform

logger = init_logger(__name__)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TritonMoEMethod(MoEMethod):
    name = "triton fused_moe"
    capturable = True

    def process_weights_after_loading(self, layer) -> None:
        for p in (layer.w13_weight, layer.w2_weight):
            if not p.is_contiguous():
                p.data = p.data.contiguous()

    def apply(self, layer, x, topk_weights, topk_ids):
        from omniinfer.kernels.triton.fused_moe import fused_moe

        return fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)


class TritonModelTransform(ModelTransform):
    """Every MoE layer gets `TritonMoEMethod` when triton runs on `device_type`; otherwise the
    torch reference stays, and the reason is logged once."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self._why: list[str] | None = None

    def moe_method(self, layer):
        from omniinfer.kernels.triton import unavailable_reasons

        if self._why is None:
            self._why = unavailable_reasons(self.device_type)
            if self._why:
                logger.info("mixture-of-experts layers run the torch reference: %s", "; ".join(self._why))
        if self._why or layer.w13_weight.dtype not in DTYPES:
            return None
        return TritonMoEMethod()
