"""Quantised experts: a mixture-of-experts layer (`FusedMoE`) whose experts the checkpoint holds
quantised (a GGUF file's `ffn_*_exps` tensors, read one expert at a time) keeps each expert's
gate/up and down weights as two QuantizedWeights, as a quantised linear layer keeps its one: no
float copy, the stacked `w13_weight` / `w2_weight` parameters stay on the meta device.

Loading goes through the layer's own `weight_loader`, unchanged: it indexes `param.data[expert]`
and narrows gate and up rows (or, under tensor parallelism, down columns), which on an
:class:`ExpertSlots` are each expert's QuantSlots. Applying is :class:`QuantMoEMethod`: routing
as every method (`select_experts`), then for each routed expert its two products through the
platform's kernels for their formats (`QuantLinearMethod`, the reference where none runs), the
SiLU-and-multiply and the weighted sum as the torch reference (`routed_sum`). Where each expert's
weights are one kernel of a class with an `experts_step` (the CPU plugin's: a step's experts in
one C call), a step it takes goes there instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniinfer.models.layers.moe import MoEMethod, routed_sum
from omniinfer.quantization.base import QuantizedWeight, QuantLinearMethod, QuantSlot


class ExpertSlots:
    """Stands in for a FusedMoE's stacked weight while it loads: `data[e]` is expert e's QuantSlot
    (shape [rows, cols] of one expert's part of the stack)."""

    def __init__(self, num_experts: int, shape: tuple[int, int], name: str):
        self.name = name
        self.slots = [QuantSlot(shape, f"{name}[expert {e}]") for e in range(num_experts)]

    @property
    def data(self) -> ExpertSlots:
        return self

    def __getitem__(self, expert: int) -> QuantSlot:
        return self.slots[expert]

    def finish(self, device: torch.device) -> list[ExpertLinear]:
        return [ExpertLinear(slot.finish(device=device)) for slot in self.slots]


class ExpertLinear:
    """One expert's gate/up or down weight, as a QuantLinearMethod sees a layer."""

    __slots__ = ("qweight", "quant_kernels", "quant_choices")

    def __init__(self, qweight: QuantizedWeight):
        self.qweight = qweight
        self.quant_kernels: list = []
        self.quant_choices: list = []


class QuantExperts:
    """A layer's experts: `w13[e]` (gate rows, then up rows, this rank's) and `w2[e]` (down)."""

    def __init__(self, w13: list[ExpertLinear], w2: list[ExpertLinear]):
        self.w13, self.w2 = w13, w2

    @property
    def nbytes(self) -> int:
        return sum(x.qweight.nbytes for x in (*self.w13, *self.w2))


class QuantMoEMethod(MoEMethod):
    """The routed experts of a layer with `qexperts`, each product through its format's kernel."""

    name = "quantised experts"

    def __init__(self, linear: QuantLinearMethod):
        self.linear = linear
        self.step = None  # the platform's step (QuantKernel.experts_step), where it has one

    def process_weights_after_loading(self, layer) -> None:
        layer.quant_choices = []
        experts = (*layer.qexperts.w13, *layer.qexperts.w2)
        for expert in experts:
            self.linear.process_weights_after_loading(expert)
            layer.quant_choices.extend(expert.quant_choices)
        single = [e.quant_kernels[0][1] for e in experts if len(e.quant_kernels) == 1]  # (one kernel a weight)
        if len(single) == len(experts) and len({type(k) for k in single}) == 1:
            n = len(layer.qexperts.w13)
            self.step = type(single[0]).experts_step(single[:n], single[n:])

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.step is not None:  # (one call on the platform, where it takes the step)
            out = self.step(x, topk_weights, topk_ids)
            if out is not None:
                return out
        experts, linear = layer.qexperts, self.linear

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            gate, up = linear.apply(experts.w13[e], xs).chunk(2, dim=-1)
            return linear.apply(experts.w2[e], F.silu(gate) * up)

        return routed_sum(x, topk_weights, topk_ids, layer.num_experts, expert)
