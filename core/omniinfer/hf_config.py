"""Readings of a Hugging Face config.json that more than one model family shares: rope
parameters in either spelling, and which layers use sliding-window attention."""

from __future__ import annotations


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def rope_scaling(cfg: dict) -> dict | None:
    """The rope scaling dict in either spelling (transformers 4 `rope_scaling`, 5 `rope_parameters`)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or None
    if not params:
        return None
    params = dict(params)
    kind = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = kind
    return None if kind == "default" else params


def rope_theta(cfg: dict) -> float:
    return _rope_theta(cfg)


def layer_kinds(cfg: dict, num_layers: int, quiet: bool = False) -> list[bool]:
    """Per layer: whether it is a sliding-window layer."""
    types = cfg.get("layer_types")
    if types:
        allowed = {"sliding_attention", "full_attention"}
        if len(types) != num_layers or not set(types) <= allowed:
            if quiet:
                return [False] * num_layers
            raise ValueError(f"layer_types={types!r} must name one of {sorted(allowed)} for each of "
                             f"the {num_layers} layers")
        return [t == "sliding_attention" for t in types]
    kind = cfg.get("model_type")
    if kind == "gemma2":  # transformers 4.x configs: even layers slide
        return [i % 2 == 0 for i in range(num_layers)]
    if kind == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return [(i + 1) % pattern != 0 for i in range(num_layers)]
    return [True] * num_layers
