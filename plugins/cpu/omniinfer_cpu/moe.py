"""The CPU mixture-of-experts method: ``omni_moe`` for up to `max_rows` tokens, reading only the
routed experts' weights (a batch-1 decode step reads its top-k experts and no other); larger
batches (prefills) run the core's torch reference, whose per-expert products go to oneDNN."""

from __future__ import annotations

import torch

from omniinfer.models.layers.moe import MoEMethod
from omniinfer_cpu.linear import DTYPE_CODES

MAX_ROWS = 16  # tokens a step up to which the kernel runs (above: the torch reference)


class CpuMoEMethod(MoEMethod):
    name = "omni_moe"

    def __init__(self, kernels, max_rows: int = MAX_ROWS):
        self.kernels = kernels
        self.max_rows = max_rows

    def process_weights_after_loading(self, layer) -> None:
        for p in (layer.w13_weight, layer.w2_weight):
            if not p.is_contiguous():
                p.data = p.data.contiguous()

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = layer.w13_weight, layer.w2_weight
        if (x.dtype not in DTYPE_CODES or w13.dtype != x.dtype or x.dim() != 2
                or not 0 < x.shape[0] <= self.max_rows):
            return super().apply(layer, x, topk_weights, topk_ids)
        if x.stride(1) != 1:
            x = x.contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.to(torch.float32).contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        num_experts, two_i, hidden = w13.shape
        rc = self.kernels.moe(x.data_ptr(), x.stride(0), w13.data_ptr(), w2.data_ptr(), ids.data_ptr(),
                              weights.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], ids.shape[1],
                              num_experts, hidden, two_i // 2, DTYPE_CODES[x.dtype],
                              torch.get_num_threads())
        if rc == -1:
            raise ValueError(f"topk_ids hold an expert outside [0, {num_experts})")
        if rc != 0:
            raise MemoryError("omni_moe could not allocate its work buffers")
        return out
