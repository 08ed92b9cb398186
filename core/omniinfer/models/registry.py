"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("omniinfer.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("omniinfer.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("omniinfer.models.llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("omniinfer.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("omniinfer.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("omniinfer.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(architecture: str, config_path: str) -> type:
    if architecture not in _MODELS:
        raise ValueError(f"architecture {architecture!r} ({config_path}) is not supported; "
                         f"supported: {', '.join(supported_architectures())}")
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
