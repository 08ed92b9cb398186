"""Qwen3: the Llama decoder with an RMSNorm over each head of the queries and keys before the
rotary embedding (`q_norm`, `k_norm`), no q/k/v bias unless `attention_bias`."""

from __future__ import annotations

from omniinfer.config import ModelConfig
from omniinfer.models.layers.norm import RMSNorm
from omniinfer.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


def norm_heads(norm, x, head_size: int):
    """`norm` over each head of x [T, heads * head]."""
    shape = x.shape
    return norm(x.reshape(-1, head_size)).view(shape)


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, attn_backend, layer_index: int = 0):
        super().__init__(config, attn_backend, layer_index)
        eps = float(config.hf_config.get("rms_norm_eps", 1e-6))
        self.head_size = config.head_size
        self.q_norm = RMSNorm(config.head_size, eps)
        self.k_norm = RMSNorm(config.head_size, eps)

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = norm_heads(self.q_norm, q, self.head_size), norm_heads(self.k_norm, k, self.head_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention
    stackable = True  # (DecoderLayerSpec's "head_norms")


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
