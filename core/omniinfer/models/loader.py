"""Build a model for this rank and fill it from a Hugging Face checkpoint (safetensors, or
PyTorch .bin files), a GGUF file or a quantised checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from omniinfer.config import ModelConfig
from omniinfer.logger import init_logger
from omniinfer.models.layers.weights import (
    CheckpointTensor,
    FileTensor,
    WeightShapeError,
    WeightValueError,
)
from omniinfer.models.registry import model_class
from omniinfer.quantization.choice import CHECKPOINT_METHODS, quantized_at_load

logger = init_logger(__name__)
INDEX_FILE = "model.safetensors.index.json"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the file and the tensor."""


def _indexed(model_dir: str, index: str) -> list[str]:
    with open(index, encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map", {})
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.isfile(os.path.join(model_dir, f))]
    if missing:
        raise CheckpointError(f"{index} lists shard(s) that do not exist: {', '.join(missing)}")
    return [os.path.join(model_dir, f) for f in files]


def checkpoint_files(model_dir: str) -> list[str]:
    """The weight files of a Hugging Face checkpoint: safetensors where there are any (as
    transformers prefers them), else PyTorch `pytorch_model*.bin` files (older checkpoints)."""
    for index in (INDEX_FILE, BIN_INDEX_FILE):
        if os.path.isfile(os.path.join(model_dir, index)):
            return _indexed(model_dir, os.path.join(model_dir, index))
    names = os.listdir(model_dir)
    files = sorted(f for f in names if f.endswith(".safetensors"))
    if not files:
        files = sorted(f for f in names if f.startswith("pytorch_model") and f.endswith(".bin"))
    if not files:
        raise CheckpointError(f"no weights in {model_dir}: expected *.safetensors or "
                              "pytorch_model*.bin files")
    return [os.path.join(model_dir, f) for f in files]


def _load_bin(path: str) -> dict[str, torch.Tensor]:
    """A PyTorch state dict, read with `weights_only` (tensors and plain containers only: a
    pickle that would run code is refused) and memory-mapped where the file allows it."""
    import pickle

    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # (the legacy format)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{path} could not be read as PyTorch weights (weights_only: tensors "
                              f"only, no code): {type(e).__name__}: {str(e).splitlines()[0]}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointError(f"{path} is not a state dict of tensors (got {type(state).__name__})")
    return state


def checkpoint_names(files: list[str]) -> set[str]:
    """The names of every tensor in `files`, read from their headers (a .bin file is mapped)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in files:
        if path.endswith(".bin"):
            names.update(_load_bin(path))
        else:
            with safe_open(path, framework="pt") as handle:
                names.update(handle.keys())  # noqa: SIM118 - safe_open is not a dict
    return names


def iterate_checkpoint(files: list[str], progress: bool = True) -> Iterator[tuple[str, CheckpointTensor]]:
    from safetensors import safe_open

    with tqdm(total=len(files), desc="Loading checkpoint shards", unit="shard",
              disable=not progress) as bar:
        for path in files:
            if path.endswith(".bin"):
                state = _load_bin(path)
                while state:  # (each tensor let go once loaded)
                    name, tensor = state.popitem()
                    yield name, FileTensor(name, path, tensor)
            else:
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
    files = checkpoint_files(config.model)
    # GPTQ / AWQ / compressed-tensors / FP8 checkpoints (not a float one quantised as it loads)
    if config.quantization in CHECKPOINT_METHODS and not quantized_at_load(config.quantization, config.hf_config):
        from omniinfer.quantization.int_pieces import int_checkpoint

        return int_checkpoint(config.hf_config["quantization_config"], files, progress)
    return iterate_checkpoint(files, progress), set()


# a multimodal checkpoint's weights, as its text model names them: transformers 5 writes
# "model.language_model.X", 4.5x wrote "language_model.model.X" (and "language_model.lm_head.X")
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_OTHER_PARTS = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                "multi_modal_projector.", "model.vision_model.", "vision_model.")


def text_part_names(checkpoint):
    """(name, tensor) of a multimodal checkpoint's language model, named as the text model's
    own checkpoint names them; the vision tower and projector are left in the file."""
    for name, tensor in checkpoint:
        if name.startswith(_OTHER_PARTS):
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield name, tensor


def load_model(config: ModelConfig, attn_backend, device: torch.device, progress: bool = True,
               quant_kernels: list | None = None):
    """This rank's part of the model, on `device`, in `config.dtype`, weights loaded; quantised
    layers (a GGUF file's or a GPTQ/AWQ/compressed-tensors checkpoint's, or all linear layers with
    quantization="int8") get their formats' methods, which run `quant_kernels` (the platform's) where they can."""
    from omniinfer.models.layers.weights import deferred_weights
    from omniinfer.quantization import int8, loading

    config_file = config.model if config.quantization == "gguf" else os.path.join(config.model, "config.json")
    cls = model_class(config.architecture, config_file)
    at_load = quantized_at_load(config.quantization, config.hf_config)  # (int8, fp8)
    deferred = not at_load and (config.quantization == "gguf" or config.quantization in CHECKPOINT_METHODS)
    with _default_dtype(config.dtype), torch.device(device), \
            (deferred_weights() if deferred else contextlib.nullcontext()):
        model = cls(config, attn_backend)
    checkpoint, quantized = _checkpoint(config, progress)
    if config.text_part_of is not None:
        checkpoint = text_part_names(checkpoint)
        quantized = {name for name, _ in text_part_names((q, None) for q in quantized)}
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
    except WeightValueError as e:
        name = next(reversed(where))
        raise CheckpointError(f"tensor {name!r} in {where[name]}: {e}") from None
    except KeyError as e:
        name = e.args[0]
        raise CheckpointError(f"tensor {name!r} in {where.get(name, config.model)} does not belong "
                              f"to {config.architecture}") from None
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        wanted = model.expected_checkpoint_names(missing[0])
        raise CheckpointError(f"tensor(s) {', '.join(map(repr, wanted))} missing from the checkpoint "
                              f"in {config.model} ({len(missing)} parameter(s) not loaded)")
    if at_load:
        from omniinfer.quantization import fp8

        int8.quantize_model(model, int8.quantize if config.quantization == "int8" else fp8.quantize)
    if deferred or at_load:
        loading.finish(model, device, quant_kernels or [])
    _drop_weight_loaders(model)
    return model.eval()


def _drop_weight_loaders(model: torch.nn.Module) -> None:
    """Each parameter's `weight_loader` is its layer's bound method: a cycle (layer -> parameter
    -> method -> layer) that only the cyclic collector frees. The engine freezes what it loaded
    (gc.freeze), so a model in such cycles outlived its engine: every LLM made again in one
    process kept the last one's weights. Loading is done; the loaders go."""
    for param in model.parameters():
        param.__dict__.pop("weight_loader", None)
