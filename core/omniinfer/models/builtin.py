"""The core's own model architectures, registered through the `omniinfer_models` hook exactly
as a plugin's are (the plugin registry registers this module first, under the name "omniinfer")."""

from __future__ import annotations

from omniinfer.platforms.hookspec import hookimpl

_LLAMA = "omniinfer.models.llama:LlamaForCausalLM"


@hookimpl
def omniinfer_models():
    return {
        "LlamaForCausalLM": _LLAMA,
        "MistralForCausalLM": _LLAMA,
        "Qwen2ForCausalLM": _LLAMA,
        "Qwen3ForCausalLM": "omniinfer.models.qwen3:Qwen3ForCausalLM",
        "Gemma2ForCausalLM": "omniinfer.models.gemma2:Gemma2ForCausalLM",
        "Gemma3ForCausalLM": "omniinfer.models.gemma3:Gemma3ForCausalLM",
        "Phi3ForCausalLM": "omniinfer.models.phi3:Phi3ForCausalLM",
        "MixtralForCausalLM": "omniinfer.models.mixtral:MixtralForCausalLM",
        "Qwen2MoeForCausalLM": "omniinfer.models.qwen2_moe:Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM": "omniinfer.models.qwen3_moe:Qwen3MoeForCausalLM",
    }
