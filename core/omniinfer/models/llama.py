"""Llama-family decoder (Llama 1-3, Mistral, Qwen2), written once for any TP/PP size.

Differences between the three are configuration: Qwen2 has q/k/v biases, Mistral may have
a sliding window, Llama 3 scales its rotary frequencies.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from omniinfer.attention.layer import Attention
from omniinfer.checkpoint_config import rope_scaling, rope_theta
from omniinfer.config import ModelConfig
from omniinfer.distributed import parallel_state as ps
from omniinfer.models.intermediate import IntermediateTensors
from omniinfer.models.layers.decoder_stack import DecoderLayerSpec, DecoderStack
from omniinfer.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from omniinfer.models.layers.layer_ops import SiluAndMul
from omniinfer.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from omniinfer.models.layers.norm import RMSNorm
from omniinfer.models.layers.rotary import RotaryEmbedding, rotary_dim
from omniinfer.models.layers.weights import default_weight_loader


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        # silu(gate) * up comes out of gate_up_proj: a platform may fuse it into the product
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias,
                                                       silu_and_mul=SiluAndMul())
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


def make_rotary(config: ModelConfig, theta: float | None = None, scaling: dict | None = None,
                use_config_scaling: bool = True) -> RotaryEmbedding:
    """The rotary embedding the config describes (theta / scaling given: those instead)."""
    cfg = config.hf_config
    if use_config_scaling and scaling is None:
        scaling = rope_scaling(cfg)
    if scaling is not None and "original_max_position_embeddings" not in scaling \
            and cfg.get("original_max_position_embeddings"):
        scaling = {**scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    if scaling is not None and "partial_rotary_factor" in scaling:  # (transformers 5 keeps it there)
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
    return RotaryEmbedding(config.head_size, int(cfg.get("max_position_embeddings", 2048)),
                           rope_theta(cfg) if theta is None else theta, scaling,
                           num_positions=config.max_model_len, rotary_dim=rotary_dim(cfg, config.head_size))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, attn_backend, layer_index: int = 0):
        super().__init__()
        cfg = config.hf_config
        bias = bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2"
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_size, config.num_heads,
                                          config.num_kv_heads, bias=bias)
        self.q_size = self.qkv_proj.num_heads * config.head_size
        self.kv_size = self.qkv_proj.num_kv_heads * config.head_size
        self.o_proj = RowParallelLinear(config.num_heads * config.head_size, config.hidden_size,
                                        bias=bool(cfg.get("attention_bias", False)))
        self.rotary_emb = make_rotary(config)
        self.attn = Attention(attn_backend, self.qkv_proj.num_heads, config.head_size,
                              config.head_size ** -0.5, self.qkv_proj.num_kv_heads,
                              sliding_window=config.layer_windows[layer_index])

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention
    stackable = True  # DecoderLayerSpec's formula is this layer's (a subclass says so for itself)

    def __init__(self, config: ModelConfig, attn_backend, layer_index: int = 0):
        super().__init__()
        cfg = config.hf_config
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.self_attn = self.attention_cls(config, attn_backend, layer_index)
        self.mlp = LlamaMLP(config.hidden_size, int(cfg["intermediate_size"]), bool(cfg.get("mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, positions, hidden_states, residual, kv_cache, attn_metadata):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaForCausalLM(nn.Module):
    """Also the base of the other dense families: they override the class attributes and hooks
    below (`layer_cls`, `make_norm`, `embed`, `compute_logits`), never the loading."""

    layer_cls = LlamaDecoderLayer
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    stacked_params = (
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    )

    def __init__(self, config: ModelConfig, attn_backend):
        super().__init__()
        self.config = config
        cfg = config.hf_config
        self.tie_word_embeddings = bool(cfg.get("tie_word_embeddings", False))
        self.start_layer, self.end_layer = ps.layer_range(config.num_layers)
        self.is_first_stage, self.is_last_stage = ps.is_first_pp_rank(), ps.is_last_pp_rank()
        self.model = nn.Module()
        if self.is_first_stage or (self.is_last_stage and self.tie_word_embeddings):
            self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleDict({
            str(i): self.make_layer(config, attn_backend, i)
            for i in range(self.start_layer, self.end_layer)
        })
        if self.is_last_stage:
            self.model.norm = self.make_norm(config.hidden_size)
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
            if self.tie_word_embeddings:
                self.lm_head.weight = self.model.embed_tokens.weight
        self.decoder_stack: DecoderStack | None = None  # the platform's, set after loading

    def make_layer(self, config: ModelConfig, attn_backend, index: int) -> nn.Module:
        """Decoder layer `index` (`layer_cls`; a family whose layers differ overrides this)."""
        return self.layer_cls(config, attn_backend, index)

    def make_norm(self, hidden_size: int) -> nn.Module:
        return RMSNorm(hidden_size, float(self.config.hf_config.get("rms_norm_eps", 1e-6)))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    @property
    def num_local_layers(self) -> int:
        return self.end_layer - self.start_layer

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata,
                intermediate_tensors: IntermediateTensors | None = None):
        """Hidden states of every token (last stage), or IntermediateTensors for the next stage.

        kv_caches holds this stage's layers only, in order."""
        if self.is_first_stage:
            hidden_states, residual = self.embed(input_ids), None
        else:
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        stacked = None if self.decoder_stack is None else self.decoder_stack(
            positions, hidden_states, residual, kv_caches, attn_metadata)
        if stacked is not None:
            hidden_states, residual = stacked
        else:
            for i, layer in enumerate(self.model.layers.values()):
                hidden_states, residual = layer(positions, hidden_states, residual, kv_caches[i],
                                                attn_metadata)
        if not self.is_last_stage:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.model.norm(hidden_states, residual)
        return hidden_states

    @classmethod
    def decoder_stack_refusal(cls) -> str | None:
        """Why a platform's one-call decoder stack can never run this family's layers (None: it
        can, without tensor parallelism and when its layers' windows agree); `omniinfer env`
        shows it per architecture."""
        if not cls.layer_cls.__dict__.get("stackable", False):  # (each layer class says so itself)
            return (f"its layers ({cls.layer_cls.__name__}) are not Llama's pre-norm attention and "
                    "gated-SiLU MLP")
        return None

    def decoder_layer_specs(self) -> list[DecoderLayerSpec] | None:
        """This stage's layers, described for `ModelRunner.decoder_stack`; None under tensor
        parallelism (o_proj and down_proj reduce across ranks) and for layers other than Llama's
        (the spec's formula is this layer's)."""
        if ps.get_tp_size() > 1 or self.decoder_stack_refusal() is not None:
            return None
        if len(set(self.config.layer_windows)) > 1:  # sliding and full layers read different tables
            return None
        out = []
        for layer in self.model.layers.values():
            attn = layer.self_attn
            out.append(DecoderLayerSpec(layer.input_layernorm, attn.qkv_proj, attn.rotary_emb, attn.attn,
                                        attn.o_proj, layer.post_attention_layernorm,
                                        q_norm=getattr(attn, "q_norm", None), k_norm=getattr(attn, "k_norm", None),
                                        **self.mlp_spec(layer.mlp)))
        return out

    def mlp_spec(self, mlp: nn.Module) -> dict:
        """A layer's MLP as DecoderLayerSpec's fields (a family with another MLP says its own)."""
        return {"gate_up_proj": mlp.gate_up_proj, "down_proj": mlp.down_proj}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def compute_greedy_tokens(self, hidden_states: torch.Tensor, argmax_rows) -> torch.Tensor:
        """argmax_rows(compute_logits(hidden_states)), possibly without the logits."""
        return self.lm_head.greedy_tokens(hidden_states, argmax_rows)

    # ---- weights -----------------------------------------------------------------------------
    def checkpoint_target(self, name: str) -> tuple[str, object] | None:
        """Our parameter name and shard id for a checkpoint tensor, or None to skip it."""
        if "rotary_emb.inv_freq" in name or name.startswith("model.rotary_emb."):
            return None
        if name.startswith("lm_head.") and (self.tie_word_embeddings or not self.is_last_stage):
            return None
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if not self.start_layer <= index < self.end_layer:
                return None
        if name.startswith("model.embed_tokens.") and not hasattr(self.model, "embed_tokens"):
            return None
        if name.startswith("model.norm.") and not self.is_last_stage:
            return None
        for ckpt, ours, shard in self.stacked_params:
            if ckpt in name:
                return name.replace(ckpt, ours), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        """Copy checkpoint tensors into the parameters; returns the parameter names filled
        (a fused parameter is complete when all its shards were seen)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        seen: dict[str, set] = {}
        for name, loaded in weights:
            target = self.checkpoint_target(name)
            if target is None:
                continue
            param_name, shard = target
            if param_name not in params:
                raise KeyError(name)
            param = params[param_name]
            getattr(param, "weight_loader", default_weight_loader)(param, loaded, shard)
            seen.setdefault(param_name, set()).add(shard)
        return {n for n, shards in seen.items() if self._complete(n, shards)}

    def _complete(self, name: str, shards: set) -> bool:
        if ".qkv_proj." in name:
            return shards == {"q", "k", "v"}
        if ".gate_up_proj." in name:
            return shards == {0, 1}
        return True

    def expected_checkpoint_names(self, param_name: str) -> list[str]:
        """The checkpoint tensors that feed one of our parameters (for error messages)."""
        for _, ours, _ in self.stacked_params:
            if ours in param_name:
                return [param_name.replace(ours, c) for c, o, _ in self.stacked_params if o == ours]
        return [param_name]
