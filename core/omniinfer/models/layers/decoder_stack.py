"""A model's decoder layers described for a platform that runs them all in one call.

Between two kernels of a layer the model's Python costs microseconds: at batch 1 on a CPU, ten
or so calls a layer add up to ~10% of a token. A platform that can run a whole stack of layers
in one call of its own (`ModelRunner.decoder_stack`) gets each layer as a `DecoderLayerSpec`:
the modules themselves, with whatever the platform put on them at load (packed weights), and a
formula it must follow. It returns a `DecoderStack`, or None to leave the layers to the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from omniinfer.attention.backend import AttentionMetadata
from omniinfer.attention.layer import Attention
from omniinfer.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from omniinfer.models.layers.moe import FusedMoE
from omniinfer.models.layers.norm import RMSNorm
from omniinfer.models.layers.rotary import RotaryEmbedding


@dataclass(frozen=True, slots=True)
class DecoderLayerSpec:
    """One pre-norm Llama-family layer of one rank (no reduction between its products):

        h = x + o_proj(attn(rotary(q), rotary(k), v)),  q | k | v = qkv_proj(input_norm(x))
        y = h + down_proj(silu(gate) * up),            gate | up = gate_up_proj(post_norm(h))

    where each norm with a residual adds it first (`RMSNorm(x, residual)`), and the first layer of
    the first stage has no residual yet (its input is it). A stack returns (the last down_proj's
    product, the residual), as the model's layers hand them to its final norm.

    Optional parts (`OPTIONAL_PARTS`), given only to a platform whose transform lists them in
    `decoder_stack_parts` (a stack that does not know a part would compute another formula):
    "head_norms": `q_norm` and `k_norm` set (Qwen3): q and k normalised head by head,
    `q_norm(q[:, h * head:(h + 1) * head])` for each head h (k likewise), before the rotary.
    "experts": `router` and `experts` set, gate_up_proj and down_proj None (a sparse layer of
    Mixtral or Qwen3-MoE, without a shared expert): the MLP is `experts.routed(m,
    router(m))`, m = post_norm(h): the top-k of the router's softmax (`select_experts`, the
    experts' `top_k` and `renormalize`), each routed expert's SwiGLU weighted by its
    probability, summed."""

    input_norm: RMSNorm
    qkv_proj: QKVParallelLinear
    rotary: RotaryEmbedding
    attn: Attention
    o_proj: RowParallelLinear
    post_norm: RMSNorm
    gate_up_proj: MergedColumnParallelLinear | None  # built with silu_and_mul: its product is silu(gate) * up
    down_proj: RowParallelLinear | None
    q_norm: RMSNorm | None = None  # "head_norms": over each head of q
    k_norm: RMSNorm | None = None  # and of k
    router: ReplicatedLinear | None = None  # "experts": the router's logits
    experts: FusedMoE | None = None  # and the routed experts

    def parts(self) -> frozenset[str]:
        """The optional parts this layer has."""
        return frozenset(part for part, there in (("head_norms", self.q_norm is not None),
                                                  ("experts", self.experts is not None)) if there)


OPTIONAL_PARTS = frozenset({"head_norms", "experts"})


class DecoderStack(Protocol):
    def __call__(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                 residual: torch.Tensor | None, kv_caches: list[torch.Tensor],
                 attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every described layer over this step's tokens (kv_caches: one per layer, in order):
        (hidden_states, residual) as the layers one by one would give them, or None, having
        done nothing, when this step is not one it serves (the model then runs its layers)."""
