"""Mixture of experts: a router, routed top-k experts, and an optional shared expert.

`FusedMoE` holds every expert of one layer as two stacked weights, in the checkpoint's [out, in]
layout: `w13_weight` [num_experts, 2 * I, hidden] (each expert's gate rows, then its up rows) and
`w2_weight` [num_experts, hidden, I]. Under tensor parallelism each rank holds every expert with
its intermediate dimension I split (gate/up rows and down columns, Megatron style); the partial
outputs are all-reduced once per layer, the shared expert's included.

How the experts are computed is the layer's `moe_method`: the core's is the torch reference
below (every platform runs it). A platform's model transform may give a layer another after
loading (`ModelTransform.moe_method`): a compiled kernel that reads only the routed experts'
weights, a Triton grouped GEMM (omniinfer.kernels.triton.fused_moe). Routing stays in the core
(`select_experts`), so every method sees the same experts and weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniinfer.distributed import parallel_state as ps
from omniinfer.models.layers.linear import RowParallelLinear
from omniinfer.models.layers.weights import (
    WeightShapeError,
    copy_checked,
    narrow,
    shape_of,
    weight_device,
)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights [T, top_k], topk_ids [T, top_k] int64) from [T, num_experts] logits: softmax
    in float32, the top_k probabilities, divided by their sum when `renormalize` (Mixtral;
    Qwen-MoE with norm_topk_prob), as transformers routes. The weights stay float32 unless
    `weights_dtype` is given (Qwen-MoE rounds them to the logits' dtype; Mixtral does not)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        topk_weights = topk_weights.to(weights_dtype)
    return topk_weights, topk_ids


class MoEMethod:
    """How a `FusedMoE` layer computes its routed experts' sum from its loaded weights.

    `apply(layer, x, topk_weights, topk_ids)` -> [T, hidden] in x's dtype: for each token t,
    sum over k of topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, k],
    over this rank's part of I (the layer all-reduces). `process_weights_after_loading` runs once,
    before the first forward; a method's copies of the weights live in the method.

    The core's method is this torch reference: the experts one by one, in increasing order, each
    over the tokens routed to it (transformers' order of summation)."""

    name = "torch reference"
    # a decode step through it can be captured in a device graph (no host read of the routing);
    # the reference reads which experts were hit, so a model with such a layer decodes eagerly
    capturable = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        return reference_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)


def reference_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum in torch (the oracle every MoE kernel is tested against)."""

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(xs, w13[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2[e])

    return routed_sum(x, topk_weights, topk_ids, w13.shape[0], expert)


def routed_sum(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
               expert) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert(e, x_t), e = topk_ids[t, k]: the experts one by one,
    in increasing order, each over the tokens routed to it (`expert(e, xs)` -> [n, hidden])."""
    out = torch.zeros_like(x)
    if x.shape[0] == 1:  # (decode at batch 1: the routed experts straight from the list, no masks)
        for k, e in sorted(enumerate(topk_ids[0].tolist()), key=lambda pair: pair[1]):
            out += (expert(e, x) * topk_weights[:, k, None]).to(out.dtype)
        return out
    hit = torch.bincount(topk_ids.flatten(), minlength=num_experts).nonzero().flatten().tolist()
    for e in hit:
        token_idx, k_idx = torch.where(topk_ids == e)
        y = expert(e, x[token_idx]) * topk_weights[token_idx, k_idx, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


DEFAULT_MOE_METHOD = MoEMethod()


def install_moe_methods(model: nn.Module, choose) -> int:
    """Give every `FusedMoE` the method `choose(layer)` returns (None keeps the reference), then
    let it process the loaded weights. Returns how many layers changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, FusedMoE) and module.qexperts is None:  # (quantised: its formats' method)
            method = choose(module)
            if method is not None:
                module.moe_method = method
                method.process_weights_after_loading(module)
                changed += 1
    return changed


def _per_rank(size: int, what: str) -> int:
    tp = ps.get_tp_size()
    if size % tp:
        raise ValueError(f"{what}={size} is not divisible by tensor_parallel_size={tp}")
    return size // tp


class FusedMoE(nn.Module):
    """`num_experts` SwiGLU experts of intermediate size `intermediate_size`, `top_k` routed per
    token. forward(x, router_logits) routes (`select_experts`), runs the method, and all-reduces
    across tensor-parallel ranks unless `reduce_results` is False (the caller adds a partial
    shared expert first and reduces once)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, round_weights: bool = False, reduce_results: bool = True,
                 what: str = "moe_intermediate_size"):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} is not allowed; it must be between 1 and "
                             f"num_experts={num_experts}")
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.renormalize, self.round_weights, self.reduce_results = renormalize, round_weights, reduce_results
        self.tp_size, self.tp_rank = ps.get_tp_size(), ps.get_tp_rank()
        self.intermediate_per_rank = i = _per_rank(intermediate_size, what)
        self.moe_method = DEFAULT_MOE_METHOD
        self.qexperts = None  # quantised experts (omniinfer.quantization.experts), in place of the two below
        device = weight_device()
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size, device=device),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i, device=device),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded, shard_id) -> None:
        """shard_id = (expert, 0 gate | 1 up | 2 down): this rank's part of one expert's tensor."""
        expert, which = shard_id
        if not 0 <= expert < self.num_experts:
            raise WeightShapeError(f"expert {expert} is out of range (num_experts={self.num_experts})")
        i, shape = self.intermediate_per_rank, shape_of(loaded)
        if which == 2:
            if tuple(shape) != (self.hidden_size, i * self.tp_size):
                raise WeightShapeError(f"expected a down projection of shape "
                                       f"({self.hidden_size}, {i * self.tp_size}), checkpoint has {shape}")
            copy_checked(param.data[expert], narrow(loaded, 1, self.tp_rank * i, i), f"expert {expert} down")
            return
        if tuple(shape) != (i * self.tp_size, self.hidden_size):
            raise WeightShapeError(f"expected a gate/up projection of shape ({i * self.tp_size}, "
                                   f"{self.hidden_size}), checkpoint has {shape}")
        copy_checked(param.data[expert].narrow(0, which * i, i), narrow(loaded, 0, self.tp_rank * i, i),
                     f"expert {expert} {'gate' if which == 0 else 'up'}")

    def routed(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the routed experts (not reduced)."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize,
                                                router_logits.dtype if self.round_weights else None)
        return self.moe_method.apply(self, x, topk_weights, topk_ids)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = self.routed(x, router_logits)
        if self.reduce_results and self.tp_size > 1:
            out = ps.tp_all_reduce(out)
        return out


class PartialRowParallelLinear(RowParallelLinear):
    """A row-parallel layer whose caller all-reduces (a shared expert summed into the routed
    experts' partial output before the layer's one all-reduce). No bias."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x)
