"""A checkpoint's config.json (or a GGUF file's metadata) -> `ModelConfig`."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from omniinfer.config import _DTYPES, ModelConfig, _check_int
from omniinfer.hf_config import rope_scaling, rope_theta  # noqa: F401 - re-exported (models import them here)
from omniinfer.logger import init_logger

logger = init_logger(__name__)


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _dimensions(cfg: dict, config_path: str) -> dict[str, int]:
    """The model's sizes from its config, each a positive integer, the heads' consistent: a
    config (or a GGUF file's metadata) that says otherwise is named here, not met later as a
    division by zero or a tensor of a nonsensical shape."""
    dims = {}
    for key, default in (("vocab_size", None), ("hidden_size", None), ("num_hidden_layers", None),
                         ("num_attention_heads", None), ("max_position_embeddings", 2048),
                         ("num_key_value_heads", 0), ("head_dim", 0)):
        value = cfg.get(key)
        if value is None:
            if default is None:
                raise ValueError(f"{config_path} has no {key!r}; the model's sizes need it")
            value = default
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key}={value!r} in {config_path} is not allowed; it must be a positive integer")
        dims[key] = value
    heads, hidden = dims["num_attention_heads"], dims["hidden_size"]
    dims["num_key_value_heads"] = dims["num_key_value_heads"] or heads
    if heads % dims["num_key_value_heads"]:
        raise ValueError(f"num_key_value_heads={dims['num_key_value_heads']} in {config_path} is not allowed; "
                         f"it must divide num_attention_heads={heads}")
    if not dims["head_dim"]:
        if hidden % heads:
            raise ValueError(f"hidden_size={hidden} in {config_path} is not a multiple of num_attention_heads="
                             f"{heads} (and no head_dim is given)")
        dims["head_dim"] = hidden // heads
    if dims["head_dim"] % 2:
        raise ValueError(f"the head size {dims['head_dim']} ({config_path}) is not allowed; rotary embeddings "
                         "need an even head size")
    return dims


def load_model_config(model: str, *, tokenizer: str | None, dtype: str | torch.dtype,
                      max_model_len: int | None, seed: int, quantization: str | None = None) -> ModelConfig:
    from omniinfer.quantization.choice import resolve_quantization
    from omniinfer.quantization.gguf_file import GGUFFile, is_gguf

    gguf = is_gguf(model)
    if not gguf and (not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model)):
        raise ValueError(f"model={model!r} is not a checkpoint directory or a .gguf file (omniinfer "
                         "loads local Hugging Face checkpoint directories, config.json + safetensors or .bin weights, "
                         "and GGUF files)")
    model = os.fspath(model)
    if gguf:
        config_path, cfg, gen = model, GGUFFile(model).hf_config(), {}
    else:
        config_path = os.path.join(model, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"model={model!r} has no config.json")
        cfg = _read_json(config_path)
        gen_path = os.path.join(model, "generation_config.json")
        gen = _read_json(gen_path) if os.path.isfile(gen_path) else {}
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"{config_path} names no architecture ('architectures' is empty)")
    text_part_of = None
    if not gguf and archs[0] in TEXT_PARTS:
        text_part_of, cfg = archs[0], _text_part(cfg, archs[0], config_path)
        archs = cfg["architectures"]
    quantization = resolve_quantization(model, cfg, quantization, gguf)

    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        resolved = _DTYPES.get(str(name), torch.float32)
    elif isinstance(dtype, str) and dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: 'auto', 'float32', "
                         "'bfloat16', 'float16'")

    dims = _dimensions(cfg, config_path)
    derived_len = dims["max_position_embeddings"]
    if max_model_len is None:
        max_model_len = derived_len
    _check_int("max_model_len", max_model_len, minimum=1)
    if max_model_len > derived_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={derived_len} ({config_path})")

    return ModelConfig(
        model=model,
        tokenizer=os.fspath(tokenizer) if tokenizer else model,
        dtype=resolved,
        max_model_len=max_model_len,
        seed=seed,
        architecture=archs[0],
        hf_config=cfg,
        vocab_size=dims["vocab_size"],
        hidden_size=dims["hidden_size"],
        num_layers=dims["num_hidden_layers"],
        num_heads=dims["num_attention_heads"],
        num_kv_heads=dims["num_key_value_heads"],
        head_size=dims["head_dim"],
        eos_token_ids=_eos_ids(gen.get("eos_token_id", cfg.get("eos_token_id"))),
        generation_config=gen,
        quantization=quantization,
        dtype_is_auto=isinstance(dtype, str) and dtype == "auto",
        text_part_of=text_part_of,
    )


# multimodal checkpoints whose language model is served alone (text in, text out; images are
# refused by the server's content checks): architecture -> (the text model's architecture, its
# model_type). Their weights: models/loader.py `text_part_names`.
TEXT_PARTS = {"Gemma3ForConditionalGeneration": ("Gemma3ForCausalLM", "gemma3_text"),
              "Mistral3ForConditionalGeneration": ("MistralForCausalLM", "mistral")}


def _text_part(cfg: dict, arch: str, config_path: str) -> dict:
    """The text model's config of a multimodal checkpoint: its `text_config` with transformers'
    defaults filled in (a checkpoint's config.json lists only what differs from them), and the
    settings of the whole that concern the text (dtype, special tokens, quantization)."""
    import transformers

    text_arch, model_type = TEXT_PARTS[arch]
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{config_path}: {arch} has no 'text_config' to serve its language model from")
    full = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in text.items() if k != "model_type"})
    out = full.to_dict()
    for key in ("torch_dtype", "dtype", "eos_token_id", "bos_token_id", "pad_token_id"):
        if cfg.get(key) is not None and key not in text:
            out[key] = cfg[key]
    for key in ("quantization_config", "tie_word_embeddings"):  # (the whole model's decide)
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    out["architectures"] = [text_arch]
    logger.info("%s: serving its language model (%s); image inputs are not supported", arch, text_arch)
    return out
