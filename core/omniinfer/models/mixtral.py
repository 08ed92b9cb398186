"""Mixtral (MixtralForCausalLM): every layer's MLP is `num_local_experts` SwiGLU experts of
`intermediate_size`, `num_experts_per_tok` routed by softmax-then-top-k, renormalised; no shared
expert, no attention biases; Mistral's `sliding_window` where set. `router_jitter_noise` and
`router_aux_loss_coef` are training-only and ignored."""

from __future__ import annotations

from omniinfer.config import ModelConfig
from omniinfer.models.moe_decoder import MoEFamily, MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM):
    @staticmethod
    def read_family(config: ModelConfig) -> MoEFamily:
        cfg = config.hf_config
        num_experts = int(cfg.get("num_local_experts", 8))
        return MoEFamily(
            num_experts=num_experts, top_k=int(cfg.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(cfg["intermediate_size"]), renormalize=True, round_weights=False,
            shared_expert_intermediate_size=0, sparse_layers=frozenset(range(config.num_layers)),
            dense_intermediate_size=int(cfg["intermediate_size"]), qkv_bias=False, qk_norm=False,
            expert_names=("w1", "w3", "w2"), renames=((".block_sparse_moe.", ".mlp."),))
