"""Build a model for this rank and fill it from a Hugging Face safetensors checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from omniinfer.config import ModelConfig
from omniinfer.logger import init_logger
from omniinfer.models.layers.weights import CheckpointTensor, WeightShapeError
from omniinfer.models.registry import model_class
from omniinfer.quantization.choice import CHECKPOINT_METHODS

logger = init_logger(__name__)
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the file and the tensor."""


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
        return [os.path.join(model_dir, f) for f in files]
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        bins = [f for f in os.listdir(model_dir) if f.endswith(".bin")]
        hint = " (found PyTorch .bin files; convert them to safetensors)" if bins else ""
        raise CheckpointError(f"no *.safetensors weights in {model_dir}{hint}")
    return [os.path.join(model_dir, f) for f in files]


def iterate_checkpoint(files: list[str], progress: bool = True) -> Iterator[tuple[str, CheckpointTensor]]:
    from safetensors import safe_open

    with tqdm(total=len(files), desc="Loading safetensors shards", unit="shard",
              disable=not progress) as bar:
        for path in files:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, CheckpointTensor(name, path, handle)
            bar.update(1)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _checkpoint(config: ModelConfig, progress: bool):
    """(name, tensor) of the checkpoint, and the names quantised in it."""
    if config.quantization == "gguf":
        from omniinfer.quantization.gguf_file import GGUFFile

        tensors = list(GGUFFile(config.model).named_tensors())
        quantized = {name for name, t in tensors if t.is_quantized}
        return iter(tensors), quantized
    files = safetensors_files(config.model)
    if config.quantization in CHECKPOINT_METHODS:  # GPTQ / AWQ / compressed-tensors
        from omniinfer.quantization.int_pieces import int_checkpoint

        return int_checkpoint(config.hf_config["quantization_config"], files, progress)
    return iterate_checkpoint(files, progress), set()


def load_model(config: ModelConfig, attn_backend, device: torch.device, progress: bool = True,
               quant_kernels: list | None = None):
    """This rank's part of the model, on `device`, in `config.dtype`, weights loaded; quantised
    layers (a GGUF file's or a GPTQ/AWQ/compressed-tensors checkpoint's, or all linear layers with
    quantization="int8") get their formats' methods, which run `quant_kernels` (the platform's) where they can."""
    from omniinfer.models.layers.weights import deferred_weights
    from omniinfer.quantization import int8, loading

    config_file = config.model if config.quantization == "gguf" else os.path.join(config.model, "config.json")
    cls = model_class(config.architecture, config_file)
    deferred = config.quantization == "gguf" or config.quantization in CHECKPOINT_METHODS
    with _default_dtype(config.dtype), torch.device(device), \
            (deferred_weights() if deferred else contextlib.nullcontext()):
        model = cls(config, attn_backend)
    checkpoint, quantized = _checkpoint(config, progress)
    if deferred:
        targets = {t[0] for t in map(model.checkpoint_target, quantized) if t is not None}
        loading.prepare(model, targets, device)
    where = {}

    def tracked():
        for name, tensor in checkpoint:
            where[name] = getattr(tensor, "path", config.model)
            yield name, tensor

    try:
        loaded = model.load_weights(tracked())
    except WeightShapeError as e:
        name = next(reversed(where))
        raise CheckpointError(f"tensor {name!r} in {where[name]} has the wrong shape: {e}") from None
    except KeyError as e:
        name = e.args[0]
        raise CheckpointError(f"tensor {name!r} in {where.get(name, config.model)} does not belong "
                              f"to {config.architecture}") from None
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        wanted = model.expected_checkpoint_names(missing[0])
        raise CheckpointError(f"tensor(s) {', '.join(map(repr, wanted))} missing from the checkpoint "
                              f"in {config.model} ({len(missing)} parameter(s) not loaded)")
    if config.quantization == "int8":
        int8.quantize_model(model)
    if deferred or config.quantization == "int8":
        loading.finish(model, device, quant_kernels or [])
    return model.eval()
