"""Gemma 2: Llama-shaped attention and a gated MLP, with

* embeddings scaled by sqrt(hidden_size), and RMSNorms of the form (1 + w) (`GemmaRMSNorm`);
* four norms a layer: before and after attention, before and after the MLP;
* GeGLU (`hidden_activation`, gelu_pytorch_tanh: the tanh approximation);
* scores scaled by `query_pre_attn_scalar ** -0.5` and soft-capped (`attn_logit_softcapping`);
* sliding-window and global layers alternating (`layer_types`, `sliding_window`);
* the final logits soft-capped (`final_logit_softcapping`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniinfer.attention.layer import Attention
from omniinfer.config import ModelConfig
from omniinfer.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from omniinfer.models.layers.norm import GemmaRMSNorm
from omniinfer.models.llama import LlamaForCausalLM, make_rotary

ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def activation(cfg: dict):
    name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_activation={name!r} is not supported; supported: "
                         f"{', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if not cap else torch.tanh(x / cap) * cap


class GemmaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        cfg = config.hf_config
        self.act = activation(cfg)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [int(cfg["intermediate_size"])] * 2,
                                                       bias=False)
        self.down_proj = RowParallelLinear(int(cfg["intermediate_size"]), config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma2Attention(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend, layer_index: int):
        super().__init__()
        cfg = config.hf_config
        bias = bool(cfg.get("attention_bias", False))
        self.head_size = config.head_size
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_size, config.num_heads,
                                          config.num_kv_heads, bias=bias)
        self.q_size = self.qkv_proj.num_heads * config.head_size
        self.kv_size = self.qkv_proj.num_kv_heads * config.head_size
        self.o_proj = RowParallelLinear(config.num_heads * config.head_size, config.hidden_size, bias=bias)
        self.is_sliding = config.layer_windows[layer_index] is not None
        self.rotary_emb = self.make_rotary(config)
        scale = float(cfg.get("query_pre_attn_scalar") or config.head_size) ** -0.5
        self.attn = Attention(attn_backend, self.qkv_proj.num_heads, config.head_size, scale,
                              self.qkv_proj.num_kv_heads, sliding_window=config.layer_windows[layer_index],
                              logits_soft_cap=config.attention_soft_cap)

    def make_rotary(self, config: ModelConfig):
        return make_rotary(config)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        return q, k

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_norm(q, k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class Gemma2DecoderLayer(nn.Module):
    attention_cls = Gemma2Attention

    def __init__(self, config: ModelConfig, attn_backend, layer_index: int):
        super().__init__()
        eps = float(config.hf_config.get("rms_norm_eps", 1e-6))
        self.self_attn = self.attention_cls(config, attn_backend, layer_index)
        self.mlp = GemmaMLP(config)
        names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
        for name in names:
            setattr(self, name, GemmaRMSNorm(config.hidden_size, eps))

    def forward(self, positions, hidden_states, residual, kv_cache, attn_metadata):
        """(hidden_states, residual) in and out as the Llama layers: their sum is the stream."""
        if residual is not None:
            hidden_states = hidden_states + residual
        residual = hidden_states
        h = self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache, attn_metadata)
        residual = residual + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(residual))
        return self.post_feedforward_layernorm(h), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma2DecoderLayer

    def __init__(self, config: ModelConfig, attn_backend):
        config.hf_config.setdefault("tie_word_embeddings", True)  # Gemma's default
        super().__init__(config, attn_backend)
        cap = config.hf_config.get("final_logit_softcapping")
        self.final_soft_cap = float(cap) if cap else None

    def make_norm(self, hidden_size: int) -> nn.Module:
        return GemmaRMSNorm(hidden_size, float(self.config.hf_config.get("rms_norm_eps", 1e-6)))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        return h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return soft_cap(super().compute_logits(hidden_states), self.final_soft_cap)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor, argmax_rows) -> torch.Tensor:
        if self.final_soft_cap is None:
            return super().compute_greedy_tokens(hidden_states, argmax_rows)
        return argmax_rows(self.compute_logits(hidden_states))
