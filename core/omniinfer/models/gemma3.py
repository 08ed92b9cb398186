"""Gemma 3 (text, `Gemma3ForCausalLM`): Gemma 2's layer with an RMSNorm over each head of the
queries and keys, five sliding-window layers to one global (`layer_types`, else
`sliding_window_pattern`), and a rotary embedding per kind of layer: the sliding layers use the
local base (`rope_local_base_freq`, transformers 5: `rope_parameters["sliding_attention"]`), the
global ones `rope_theta` and the rope scaling. No attention soft-capping (transformers ignores
`attn_logit_softcapping` for Gemma 3); the final soft cap applies when the config sets one."""

from __future__ import annotations

from omniinfer.config import ModelConfig, rope_scaling
from omniinfer.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM
from omniinfer.models.layers.norm import GemmaRMSNorm
from omniinfer.models.llama import make_rotary
from omniinfer.models.qwen3 import norm_heads

LOCAL_THETA, GLOBAL_THETA = 10_000.0, 1_000_000.0  # transformers' defaults


def layer_rope(cfg: dict, is_sliding: bool) -> tuple[float, dict | None]:
    """(theta, scaling or None) of a sliding or a global layer."""
    kind = "sliding_attention" if is_sliding else "full_attention"
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(kind), dict):
        p = dict(params[kind])
        theta = float(p.pop("rope_theta", LOCAL_THETA if is_sliding else GLOBAL_THETA))
        p["rope_type"] = p.get("rope_type", p.get("type", "default"))
        return theta, None if p["rope_type"] == "default" else p
    if is_sliding:
        return float(cfg.get("rope_local_base_freq", LOCAL_THETA)), None
    return float(cfg.get("rope_theta", GLOBAL_THETA)), rope_scaling(cfg)


class Gemma3Attention(Gemma2Attention):
    def __init__(self, config: ModelConfig, attn_backend, layer_index: int):
        super().__init__(config, attn_backend, layer_index)
        eps = float(config.hf_config.get("rms_norm_eps", 1e-6))
        self.q_norm = GemmaRMSNorm(config.head_size, eps)
        self.k_norm = GemmaRMSNorm(config.head_size, eps)

    def make_rotary(self, config: ModelConfig):
        theta, scaling = layer_rope(config.hf_config, self.is_sliding)
        return make_rotary(config, theta, scaling, use_config_scaling=False)

    def qk_norm(self, q, k):
        return norm_heads(self.q_norm, q, self.head_size), norm_heads(self.k_norm, k, self.head_size)


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer
