"""Which quantization a model loads with (`quantization=`), checked against its checkpoint."""

from __future__ import annotations

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8")  # a config.json's quantization_config
# what `quantization=` takes (a .gguf file implies "gguf"; a quantization_config its method)
QUANTIZATIONS = ("int8", "gguf", *CHECKPOINT_METHODS)
# the ones a float checkpoint is quantised into as it loads (as vLLM's --quantization fp8)
AT_LOAD = ("int8", "fp8")


def quantized_at_load(quantization: str | None, hf_config: dict) -> bool:
    """Whether the model's linear layers are quantised as they load (a float checkpoint)."""
    return quantization in AT_LOAD and not hf_config.get("quantization_config")


def resolve_quantization(model: str, cfg: dict, asked: str | None, is_gguf: bool) -> str | None:
    """The quantization a model loads with: `asked` (the `quantization=` argument) checked
    against what the checkpoint is (a .gguf file; a config.json's quantization_config)."""
    if asked is not None and asked not in QUANTIZATIONS:
        raise ValueError(f"quantization={asked!r} is not supported; allowed: None, "
                         f"{', '.join(map(repr, QUANTIZATIONS))}")
    if is_gguf:
        if asked not in (None, "gguf"):
            raise ValueError(f"quantization={asked!r} with model={model!r}: a GGUF file is loaded as it "
                             "is quantised (quantization=None or 'gguf')")
        return "gguf"
    if asked == "gguf":
        raise ValueError(f"quantization='gguf' needs a .gguf file; model={model!r} is a directory")
    qc = cfg.get("quantization_config")
    if qc is None:
        if asked in AT_LOAD:  # (a float checkpoint quantised as it loads; "fp8" also names FP8 checkpoints)
            return asked
        if asked in CHECKPOINT_METHODS:
            raise ValueError(f"quantization={asked!r}: model={model!r} has no quantization_config in its "
                             "config.json (it is a float checkpoint; quantization='int8' or 'fp8' quantises one at load)")
        return asked
    if not isinstance(qc, dict):
        raise ValueError(f"model={model!r}: config.json's quantization_config must be an object, "
                         f"got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"model={model!r} is quantised with quant_method={qc.get('quant_method')!r} "
                         f"(config.json quantization_config), which omniinfer does not load; it loads "
                         f"{', '.join(CHECKPOINT_METHODS)} checkpoints, GGUF files and float checkpoints")
    if asked not in (None, method):
        raise ValueError(f"quantization={asked!r} with model={model!r}: the checkpoint is quantised with "
                         f"{method!r} (its quantization_config); pass quantization=None or {method!r}")
    from omniinfer.quantization.int_formats import parse_quantization_config

    parse_quantization_config(qc)  # a bad or unsupported field fails here, before any weight is read
    return method
