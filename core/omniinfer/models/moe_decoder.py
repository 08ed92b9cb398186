"""What the mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) share: a Llama-shaped
decoder whose MLP is, in some or all layers, a sparse block (router, routed experts, optional
shared expert with a sigmoid gate); attention with optional q/k/v biases and optional per-head
q/k RMSNorm (Qwen3's). Each family's module says which, from its Hugging Face config
(`MoEFamily`); the weights load from the checkpoint's per-expert tensors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from omniinfer.attention.layer import Attention
from omniinfer.config import ModelConfig
from omniinfer.distributed import parallel_state as ps
from omniinfer.models.layers.layer_ops import SiluAndMul
from omniinfer.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from omniinfer.models.layers.moe import FusedMoE, PartialRowParallelLinear
from omniinfer.models.layers.norm import RMSNorm
from omniinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, make_rotary

# model.layers.{i}.mlp.experts.{e}.{name}.weight, after the family's renames
EXPERT_NAME = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")


@dataclass(frozen=True, slots=True)
class MoEFamily:
    """One family's choices, read from its config by the family's module."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    renormalize: bool  # divide the top-k probabilities by their sum
    round_weights: bool  # routing weights rounded to the model's dtype (Qwen) or kept in float32
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layers: frozenset[int]  # the layers whose MLP is the sparse block
    dense_intermediate_size: int  # the other layers' MLP
    qkv_bias: bool
    qk_norm: bool  # per-head RMSNorm of q and k before the rotary embedding (Qwen3)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # checkpoint's
    renames: tuple[tuple[str, str], ...] = ()  # checkpoint fragment -> ours (Mixtral's block_sparse_moe)


def sparse_layers(cfg: dict, num_experts: int) -> frozenset[int]:
    """Qwen-MoE's rule: layer i is sparse unless listed in mlp_only_layers, when
    (i + 1) % decoder_sparse_step == 0 and there are experts."""
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"decoder_sparse_step={step!r} in config.json is not allowed; it must be "
                         "an integer >= 1")
    dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
    layers = int(cfg["num_hidden_layers"])
    return frozenset(i for i in range(layers)
                     if num_experts > 0 and i not in dense and (i + 1) % step == 0)


def head_rms_norm(norm: RMSNorm, x: torch.Tensor, head_size: int) -> torch.Tensor:
    """`norm` (over one head's `head_size` values) applied to every head of x [T, heads * head]."""
    shape = x.shape
    return norm(x.reshape(-1, head_size)).view(shape)


class MoEAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend, family: MoEFamily):
        super().__init__()
        cfg = config.hf_config
        head = config.head_size
        self.head_size = head
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head, config.num_heads, config.num_kv_heads,
                                          bias=family.qkv_bias)
        self.q_size = self.qkv_proj.num_heads * head
        self.kv_size = self.qkv_proj.num_kv_heads * head
        self.o_proj = RowParallelLinear(config.num_heads * head, config.hidden_size, bias=False)
        if family.qk_norm:
            eps = float(cfg.get("rms_norm_eps", 1e-6))
            self.q_norm, self.k_norm = RMSNorm(head, eps), RMSNorm(head, eps)
        self.qk_norm = family.qk_norm
        self.rotary_emb = make_rotary(config)
        self.attn = Attention(attn_backend, self.qkv_proj.num_heads, head, head ** -0.5,
                              self.qkv_proj.num_kv_heads, sliding_window=config.sliding_window)

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q, k = head_rms_norm(self.q_norm, q, self.head_size), head_rms_norm(self.k_norm, k, self.head_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class SharedExpert(nn.Module):
    """A SwiGLU MLP whose down projection is left unreduced (the sparse block reduces once)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       silu_and_mul=SiluAndMul())
        self.down_proj = PartialRowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class SparseMoeBlock(nn.Module):
    """router -> routed experts (+ sigmoid(shared_expert_gate(x)) * shared_expert(x)), one
    all-reduce under tensor parallelism."""

    def __init__(self, hidden_size: int, family: MoEFamily):
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, family.num_experts, bias=False)
        self.experts = FusedMoE(family.num_experts, family.top_k, hidden_size, family.moe_intermediate_size,
                                family.renormalize, family.round_weights, reduce_results=False)
        self.has_shared = family.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = SharedExpert(hidden_size, family.shared_expert_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts.routed(x, self.gate(x))
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return ps.tp_all_reduce(out) if ps.get_tp_size() > 1 else out


class MoEDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, attn_backend, index: int, family: MoEFamily):
        nn.Module.__init__(self)
        eps = float(config.hf_config.get("rms_norm_eps", 1e-6))
        self.self_attn = MoEAttention(config, attn_backend, family)
        if index in family.sparse_layers:
            self.mlp = SparseMoeBlock(config.hidden_size, family)
        else:
            self.mlp = LlamaMLP(config.hidden_size, family.dense_intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)


class MoEForCausalLM(LlamaForCausalLM):
    """A family module subclasses this and defines `read_family(config) -> MoEFamily`."""

    @staticmethod
    def read_family(config: ModelConfig) -> MoEFamily:
        raise NotImplementedError

    def __init__(self, config: ModelConfig, attn_backend):
        self.family = self.read_family(config)
        super().__init__(config, attn_backend)

    def make_layer(self, config: ModelConfig, attn_backend, index: int) -> nn.Module:
        return MoEDecoderLayer(config, attn_backend, index, self.family)

    @classmethod
    def decoder_stack_refusal(cls) -> str | None:
        return None  # (its sparse layers: DecoderLayerSpec's "experts"; Qwen2-MoE's shared expert is not)

    def decoder_layer_specs(self):
        """Llama's, a sparse layer's MLP as the spec's "experts" part; None with a shared expert
        (no part describes it)."""
        return None if self.family.shared_expert_intermediate_size else super().decoder_layer_specs()

    def mlp_spec(self, mlp: nn.Module) -> dict:
        if isinstance(mlp, SparseMoeBlock):
            return {"gate_up_proj": None, "down_proj": None, "router": mlp.gate, "experts": mlp.experts}
        return super().mlp_spec(mlp)

    def checkpoint_target(self, name: str) -> tuple[str, object] | None:
        for ckpt, ours in self.family.renames:
            name = name.replace(ckpt, ours)
        target = super().checkpoint_target(name)
        match = EXPERT_NAME.match(name)
        if target is None or match is None:
            return target
        prefix, expert, which = match.group(1), int(match.group(2)), match.group(3)
        if which not in self.family.expert_names:
            raise KeyError(name)
        shard = self.family.expert_names.index(which)
        return f"{prefix}.{'w2_weight' if shard == 2 else 'w13_weight'}", (expert, shard)

    def _complete(self, name: str, shards: set) -> bool:
        if name.endswith(".experts.w13_weight"):
            return shards == {(e, s) for e in range(self.family.num_experts) for s in (0, 1)}
        if name.endswith(".experts.w2_weight"):
            return shards == {(e, 2) for e in range(self.family.num_experts)}
        return super()._complete(name, shards)

    def expected_checkpoint_names(self, param_name: str) -> list[str]:
        if ".experts.w" in param_name:
            prefix = param_name.rsplit(".", 1)[0]
            names = self.family.expert_names[2:] if param_name.endswith("w2_weight") else self.family.expert_names[:2]
            out = [f"{prefix}.{e}.{n}.weight" for e in range(self.family.num_experts) for n in names]
            for ckpt, ours in self.family.renames:
                out = [n.replace(ours, ckpt) for n in out]
            return out
        return super().expected_checkpoint_names(param_name)
