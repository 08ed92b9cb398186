"""Qwen2-MoE (Qwen2MoeForCausalLM; Qwen1.5-MoE, Qwen2-57B-A14B): sparse layers chosen by
`decoder_sparse_step` and `mlp_only_layers` (the others a dense MLP of `intermediate_size`);
`num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` routed, top-k
probabilities renormalised only with `norm_topk_prob`; a shared expert of
`shared_expert_intermediate_size` scaled by sigmoid(shared_expert_gate(x)); q/k/v biases
(`qkv_bias`, default true). A sliding window (`use_sliding_window`) must cover every layer
(`layer_types`): per-layer windows are refused. `router_aux_loss_coef` is training-only."""

from __future__ import annotations

from omniinfer.config import ModelConfig
from omniinfer.models.moe_decoder import MoEFamily, MoEForCausalLM, sparse_layers


def check_layer_types(cfg: dict) -> None:
    kinds = set(cfg.get("layer_types") or [])
    if cfg.get("use_sliding_window") and len(kinds) > 1:
        raise ValueError(f"layer_types={cfg['layer_types']!r} with use_sliding_window=true mixes "
                         "sliding-window and full-attention layers, which omniinfer does not run yet; "
                         "allowed: every layer one kind")


class Qwen2MoeForCausalLM(MoEForCausalLM):
    @classmethod
    def decoder_stack_refusal(cls) -> str | None:
        return "its sparse layers' shared expert (a one-call stack's MLP is the routed experts alone)"

    @staticmethod
    def read_family(config: ModelConfig) -> MoEFamily:
        cfg = config.hf_config
        check_layer_types(cfg)
        num_experts = int(cfg.get("num_experts", 60))
        return MoEFamily(
            num_experts=num_experts, top_k=int(cfg.get("num_experts_per_tok", 4)),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1408)),
            renormalize=bool(cfg.get("norm_topk_prob", False)), round_weights=True,
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 5632)),
            sparse_layers=sparse_layers(cfg, num_experts),
            dense_intermediate_size=int(cfg["intermediate_size"]),
            qkv_bias=bool(cfg.get("qkv_bias", True)), qk_norm=False)
