"""Which quantization a model loads with (`quantization=`), checked against its checkpoint."""

from __future__ import annotations

QUANTIZATIONS = ("int8", "gguf")  # what `quantization=` takes (a .gguf file implies "gguf")


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
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method:
        raise ValueError(f"model={model!r} is quantised with {method!r} (config.json quantization_config), "
                         "which this omniinfer does not load yet; it loads GGUF files and float "
                         "checkpoints (quantization='int8' quantises one at load)")
    return asked
