"""A checkpoint tensor that is read only as far as a rank needs it."""

from __future__ import annotations

import contextlib
import contextvars

import torch

_DEFERRED = contextvars.ContextVar("omniinfer_deferred_weights", default=False)


@contextlib.contextmanager
def deferred_weights():
    """Build a model whose linear and embedding weights are on the meta device (no memory): the
    loader of a quantised checkpoint then gives each layer its quantised weight, or a float one
    where the file holds it in float (omniinfer.quantization)."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def weight_device() -> str | None:
    """Where a linear or embedding layer puts its weight as it is built: "meta" while deferred."""
    return "meta" if _DEFERRED.get() else None


class CheckpointTensor:
    """One tensor of a safetensors file, read lazily: `narrow` reads just one shard's rows."""

    def __init__(self, name: str, path: str, handle, dtype: torch.dtype | None = None):
        self.name = name
        self.path = path
        self._handle = handle  # an open safetensors file (safe_open)
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def full(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)


class FileTensor:
    """One tensor of a PyTorch .bin file (memory-mapped where the file allows it), with the
    file it came from, as CheckpointTensor has."""

    def __init__(self, name: str, path: str, tensor: torch.Tensor):
        self.name = name
        self.path = path
        self._tensor = tensor
        self.shape = tuple(tensor.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._tensor.narrow(dim, start, length)

    def full(self) -> torch.Tensor:
        return self._tensor


def tensor_of(loaded) -> torch.Tensor:
    """A lazily read checkpoint tensor (safetensors, GGUF) in full, or the tensor given."""
    return loaded.full() if hasattr(loaded, "full") else loaded


def narrow(loaded, dim: int, start: int, length: int) -> torch.Tensor:
    return loaded.narrow(dim, start, length)


def shape_of(loaded) -> tuple[int, ...]:
    return tuple(loaded.shape)


class WeightShapeError(ValueError):
    pass


class WeightValueError(ValueError):
    """A checkpoint tensor whose values cannot be this parameter's as they are."""


FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def copy_checked(param: torch.Tensor, value: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise WeightShapeError(f"{what}: expected shape {tuple(param.shape)}, "
                               f"checkpoint has {tuple(value.shape)}")
    if getattr(value, "dtype", None) in FLOAT8 and param.dtype not in FLOAT8:
        # (an FP8 checkpoint's weight is its codes times a scale: copied as it is, it is wrong)
        raise WeightValueError(f"{what}: the checkpoint holds it as {value.dtype} codes, which need a scale: "
                               "an FP8 checkpoint needs its quantization_config in config.json (quant_method fp8 "
                               "or compressed-tensors) and a scale for each such tensor")
    param.data.copy_(value)


def default_weight_loader(param: torch.Tensor, loaded, shard_id=None) -> None:
    """Copy a whole, unsplit tensor (norms, replicated parameters)."""
    copy_checked(param, tensor_of(loaded), "tensor")
