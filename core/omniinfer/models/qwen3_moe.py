"""Qwen3-MoE (Qwen3MoeForCausalLM; Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen2-MoE's layout without
the shared expert, with per-head q/k RMSNorm before the rotary embedding (`head_dim` heads) and
no attention biases unless `attention_bias`; `norm_topk_prob` (true in the released models)
renormalises the top-k probabilities; `num_experts` (transformers 5 writes it as
`num_local_experts`), `decoder_sparse_step`, `mlp_only_layers`, and `sliding_window` only with
`use_sliding_window`. `router_aux_loss_coef` is training-only."""

from __future__ import annotations

from omniinfer.config import ModelConfig
from omniinfer.models.moe_decoder import MoEFamily, MoEForCausalLM, sparse_layers


class Qwen3MoeForCausalLM(MoEForCausalLM):
    @staticmethod
    def read_family(config: ModelConfig) -> MoEFamily:
        cfg = config.hf_config
        num_experts = int(cfg.get("num_experts", cfg.get("num_local_experts", 128)))
        return MoEFamily(
            num_experts=num_experts, top_k=int(cfg.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 768)),
            renormalize=bool(cfg.get("norm_topk_prob", False)), round_weights=True,
            shared_expert_intermediate_size=0, sparse_layers=sparse_layers(cfg, num_experts),
            dense_intermediate_size=int(cfg["intermediate_size"]),
            qkv_bias=bool(cfg.get("attention_bias", False)), qk_norm=True)
