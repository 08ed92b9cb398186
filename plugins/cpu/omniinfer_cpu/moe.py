"""The CPU mixture-of-experts method: ``omni_moe`` for up to `max_rows` tokens, reading only the
routed experts' weights (a batch-1 decode step reads its top-k experts and no other); larger
batches (prefills) run the core's torch reference, whose per-expert products go to oneDNN."""

from __future__ import annotations

import torch

from omniinfer.models.layers.moe import MoEMethod
from omniinfer_cpu.linear import DTYPE_CODES
from omniinfer_cpu.quant import QACT_INT8, X8_CODES

X8_KINDS = frozenset(X8_CODES.values())

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


class CpuExpertsStep:
    """A step's routed experts on quantised weights in one call: one token through `omni_qmoe`
    (each expert's gate/up and down on the blocks its CpuQuantKernel holds, as QuantMoEMethod's
    loop does, without Python between them), several (a prefill chunk) through
    `omni_qmoe_tokens` where every expert is in groups of 8 rows with int8 activations (else the
    loop takes them). float32 only (GGUF models run so)."""

    def __init__(self, w13: list, w2: list):
        self.w13, self.w2 = w13, w2
        self.k = w13[0].k
        self.hidden, self.intermediate = w13[0].piece.shape[1], w2[0].piece.shape[1]
        self.table = None  # (the weights' addresses, read at the first call: after every repack)
        codes = {k.code for k in w13}, {k.code for k in w2}
        grouped = all(len(c) == 1 and (next(iter(c)) & QACT_INT8) and (next(iter(c)) & ~QACT_INT8) in X8_KINDS
                      for c in codes)
        self.tokens_kinds = tuple(next(iter(c)) for c in codes) if grouped else None

    @staticmethod
    def of(w13: list, w2: list) -> CpuExpertsStep | None:
        h, i = w13[0].piece.shape[1], w2[0].piece.shape[1]
        if any(k.piece.shape != (2 * i, h) for k in w13) or any(k.piece.shape != (h, i) for k in w2):
            return None
        return CpuExpertsStep(w13, w2)

    def addresses(self):
        """(w13, s13, kind13, w2, s2, kind2): the experts' blocks, scales (0: none) and formats, as
        omni_qmoe takes them (int64 addresses, int32 codes); read after every repack."""
        def table(kernels):
            return (torch.tensor([k.w.data_ptr() for k in kernels], dtype=torch.int64),
                    torch.tensor([0 if k.scale is None else k.scale.data_ptr() for k in kernels], dtype=torch.int64),
                    torch.tensor([k.code for k in kernels], dtype=torch.int32))

        return (*table(self.w13), *table(self.w2))

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor | None:
        tokens = x.shape[0]
        if (x.dtype != torch.float32 or topk_weights.dtype != torch.float32 or x.dim() != 2 or tokens < 1
                or x.shape[1] != self.hidden or (tokens > 1 and self.tokens_kinds is None)):
            return None
        if self.table is None:
            self.table = self.addresses()
        x = x.contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.contiguous()
        out = torch.empty_like(x)
        if tokens == 1:
            rc = self.k.qmoe(x.data_ptr(), *(t.data_ptr() for t in self.table), ids.data_ptr(), weights.data_ptr(),
                             ids.shape[1], len(self.w13), out.data_ptr(), self.hidden, self.intermediate,
                             torch.get_num_threads())
        else:
            w13, _, _, w2, _, _ = self.table
            rc = self.k.qmoe_tokens(x.data_ptr(), tokens, w13.data_ptr(), self.tokens_kinds[0], w2.data_ptr(),
                                    self.tokens_kinds[1], ids.data_ptr(), weights.data_ptr(), ids.shape[1],
                                    len(self.w13), out.data_ptr(), self.hidden, self.intermediate,
                                    torch.get_num_threads())
        if rc != 0:
            name = "omni_qmoe" if tokens == 1 else "omni_qmoe_tokens"
            routed = ids.tolist() if ids.numel() <= 64 else f"ids of shape {tuple(ids.shape)}"
            raise RuntimeError(f"{name} failed ({rc}) for experts {routed} of {len(self.w13)}")
        return out
