"""Putting quantised weights into a model built with deferred weights (see base.py): before
loading, a QuantSlot or a real float weight for each linear / embedding layer, as the checkpoint
holds it; after loading, each slot's QuantizedWeight and its layer's QuantLinearMethod."""

from __future__ import annotations

from collections import Counter

import torch
from torch import nn

from omniinfer.logger import init_logger
from omniinfer.models.layers.moe import FusedMoE
from omniinfer.quantization.base import QuantLinearMethod, QuantSlot
from omniinfer.quantization.experts import ExpertSlots, QuantExperts, QuantMoEMethod

logger = init_logger(__name__)


def prepare(model: nn.Module, quantized: set[str], device: torch.device) -> None:
    """`quantized`: our parameter names (`model.layers.0.mlp.down_proj.weight`) whose checkpoint
    tensors are quantised. Their layers get a QuantSlot; every other deferred weight gets memory."""
    decided: dict[int, tuple[str, object]] = {}  # a shared (tied) parameter: decided once
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            _prepare_experts(module, name, quantized, device)
            continue
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter) or not weight.is_meta:
            continue
        key = id(weight)
        if key not in decided:
            pname = f"{name}.weight" if name else "weight"
            if pname in quantized:
                slot = QuantSlot(tuple(weight.shape), pname)
                layer_loader = weight.weight_loader

                def loader(param, loaded, shard_id=None, slot=slot, layer_loader=layer_loader):
                    layer_loader(slot, loaded, shard_id)

                weight.weight_loader = loader
                decided[key] = ("slot", slot)
            else:
                real = nn.Parameter(torch.zeros(weight.shape, dtype=weight.dtype, device=device),
                                    requires_grad=False)
                real.weight_loader = weight.weight_loader
                decided[key] = ("float", real)
        how, value = decided[key]
        if how == "slot":
            module.qslot = value
        else:
            module.weight = value


def _prepare_experts(layer: FusedMoE, name: str, quantized: set[str], device: torch.device) -> None:
    """Quantised experts (either stack in `quantized`: a float part is kept as a float piece) get
    ExpertSlots, loaded through the layer's own loader; float ones get memory."""
    params = {"w13_weight": layer.w13_weight, "w2_weight": layer.w2_weight}
    if not any(p.is_meta for p in params.values()):
        return
    if not any(f"{name}.{attr}" in quantized for attr in params):
        for attr, param in params.items():
            real = nn.Parameter(torch.zeros(param.shape, dtype=param.dtype, device=device), requires_grad=False)
            real.weight_loader = param.weight_loader
            setattr(layer, attr, real)
        return
    layer.qslots = []
    for attr, param in params.items():
        slots = ExpertSlots(param.shape[0], tuple(param.shape[1:]), f"{name}.{attr}")

        def loader(_param, loaded, shard_id=None, slots=slots):
            layer.weight_loader(slots, loaded, shard_id)

        param.weight_loader = loader
        layer.qslots.append(slots)


def finish(model: nn.Module, device: torch.device, kernels: list) -> Counter:
    """Each slot's weight into its layer, on `device`, with the method that applies it; returns
    how many weights (a layer's segments; a mixture of experts' experts, each gate/up and down)
    each (format, kernel) pair serves, and logs it. The pieces come from the checkpoint on the
    host (bytes a GGUF file's tensors were read into): on an accelerator each moves to the device
    here, layer by layer, before a kernel repacks it; on the CPU they stay as they are."""
    method = QuantLinearMethod(device.type, kernels)
    weights: dict[int, object] = {}
    served: Counter = Counter()
    reasons: dict[tuple[str, str], str] = {}

    def count(module) -> None:
        for kind, kernel, why in module.quant_choices:
            served[(kind, kernel)] += 1
            if why:
                reasons[(kind, kernel)] = why

    for module in model.modules():
        if getattr(module, "qslots", None) is not None:  # a FusedMoE's quantised experts
            module.qexperts = QuantExperts(*(slots.finish(device) for slots in module.qslots))
            module.moe_method = QuantMoEMethod(method)
            module.moe_method.process_weights_after_loading(module)
            del module.qslots
            count(module)
            continue
        slot = getattr(module, "qslot", None)
        if slot is None:
            continue
        if id(slot) not in weights:
            rows = getattr(module, "num_real", None)  # an embedding's padding rows stay empty
            weights[id(slot)] = slot.finish(rows, device)
        module.qweight = weights[id(slot)]
        del module.qslot
        if hasattr(module, "linear_method"):  # a linear layer or the LM head (an embedding looks up)
            module.linear_method = method
            method.process_weights_after_loading(module)
            count(module)
    for (kind, kernel), count in sorted(served.items()):
        why = reasons.get((kind, kernel))
        logger.info("quantised weights: %d x %s -> %s%s", count, kind, kernel, f" ({why})" if why else "")
    return served


def quantized_bytes(model: nn.Module) -> int:
    """The bytes the model's quantised weights hold (each shared weight once)."""
    seen = {id(m.qweight): m.qweight for m in model.modules() if getattr(m, "qweight", None) is not None}
    experts = sum(m.qexperts.nbytes for m in model.modules() if getattr(m, "qexperts", None) is not None)
    return sum(w.nbytes for w in seen.values()) + experts
