"""Choosing the attention backend: by capability, with every refusal explained."""

from __future__ import annotations

import os

from omniinfer.attention.backend import AttentionBackend, AttentionSpec

ENV_BACKEND = "OMNIINFER_ATTENTION_BACKEND"


def candidate_names(preferences: tuple[str, ...], backends: dict[str, type[AttentionBackend]],
                    device_type: str) -> list[str]:
    """The platform's preferences in order, then other installed backends for its device type
    (how a third-party backend joins an existing platform without being named)."""
    names = list(preferences)
    names += [n for n, cls in backends.items()
              if n not in names and device_type in cls.supported_device_types]
    return names


def select_attention_backend(platform: type, spec: AttentionSpec,
                             backends: dict[str, type[AttentionBackend]],
                             requested: str | None = None) -> type[AttentionBackend]:
    source = "attention_backend="
    if not requested:
        requested, source = os.environ.get(ENV_BACKEND) or None, f"{ENV_BACKEND}="
    if requested:
        name = requested.strip().upper()
        if name not in backends:
            raise ValueError(f"{source}{requested!r} is not an installed attention backend; "
                             f"installed: {', '.join(sorted(backends))}")
        reasons = backends[name].validate(spec)
        if reasons:
            raise ValueError(f"{source}{requested!r} cannot serve this configuration on "
                             f"{platform.name}: {'; '.join(reasons)}")
        return backends[name]
    refusals = []
    for name in candidate_names(platform.attention_backend_preferences, backends, spec.device_type):
        cls = backends.get(name)
        reasons = ["not installed (no loaded plugin provides it)"] if cls is None else cls.validate(spec)
        if not reasons:
            return cls
        refusals.append(f"  {name}: {'; '.join(reasons)}")
    raise ValueError(f"no attention backend can serve this configuration on {platform.name} "
                     f"(dtype {str(spec.dtype).removeprefix('torch.')}, head size {spec.head_size}, "
                     f"device type {spec.device_type}, block size "
                     f"{spec.block_size}); candidates:\n" + "\n".join(refusals))


def backend_for_model(platform: type, model, config, tp_size: int = 1) -> type[AttentionBackend]:
    """The attention backend for `model` (a ModelConfig: the target's, or a draft's) on one of
    `tp_size` tensor-parallel ranks, as `config.device.attention_backend` asks."""
    from omniinfer.platforms.registry import get_registry

    spec = platform.attention_spec(
        dtype=model.dtype, head_size=model.head_size, num_heads=model.num_heads // tp_size,
        num_kv_heads=max(1, model.num_kv_heads // tp_size), block_size=config.cache.block_size,
        sliding_window=model.sliding_window, logits_soft_cap=model.attention_soft_cap)
    return select_attention_backend(platform, spec, get_registry().backends,
                                    config.device.attention_backend)
