"""Linear layers split for tensor parallelism (Megatron style).

Weights are [out, in] like the checkpoint. Column-parallel layers split `out` across the
TP ranks; row-parallel layers split `in` and all-reduce their output. Each parameter
has a `weight_loader(param, loaded, shard_id)` that copies this rank's part of a
checkpoint tensor, reading only that part from disk.

How a layer multiplies is its `linear_method` (torch's `F.linear` unless a platform's model
runner installs another after loading: see `install_linear_methods`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniinfer.distributed import parallel_state as ps
from omniinfer.models.layers.weights import (
    WeightShapeError,
    copy_checked,
    narrow,
    shape_of,
    weight_device,
)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={d}")
    return n // d


class LinearMethod:
    """How a layer computes ``x @ weight.T (+ bias)`` from its loaded `weight` ([out, in]).

    The core's method is torch's `F.linear`. A platform's model runner may give a layer its own
    method after the weights are loaded (`ModelRunner.linear_method`): a faster kernel, a
    repacked copy of the weight. `process_weights_after_loading` runs once, before the first
    forward; the layer keeps `weight` as it is (a tied embedding reads the same tensor).
    """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def apply_silu_and_mul(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                           silu_and_mul: nn.Module) -> torch.Tensor:
        """silu(gate) * up for a merged [gate; up] layer built with `silu_and_mul` (its
        `silu_and_mul` attribute is set, so a method can tell such layers apart when it packs
        them): here `silu_and_mul` applied to `apply`'s product. A platform may do both in one
        pass."""
        return silu_and_mul(self.apply(layer, x, bias))

    def apply_argmax(self, layer: nn.Module, x: torch.Tensor, argmax_rows) -> torch.Tensor:
        """The column of each row's first maximum of `apply(layer, x)` ([rows] int64): what the
        greedy sampler takes from an LM head's logits. Here `argmax_rows` on the product; a
        platform may find the maxima as it multiplies, without writing the logits, but must
        return the same tokens (the product as `apply` would round it, a NaN counting as the
        greatest, as torch.argmax)."""
        return argmax_rows(self.apply(layer, x))


DEFAULT_LINEAR_METHOD = LinearMethod()


def install_linear_methods(model: nn.Module, choose) -> int:
    """Give every layer with a `linear_method` the one `choose(layer)` returns (None keeps the
    layer's own), then let it process the loaded weights. Returns how many layers changed."""
    changed = 0
    for module in model.modules():
        if getattr(module, "qweight", None) is not None:
            continue  # a quantised layer: its method is its format's (omniinfer.quantization)
        if isinstance(getattr(module, "linear_method", None), LinearMethod):
            method = choose(module)
            if method is not None:
                module.linear_method = method
                method.process_weights_after_loading(module)
                changed += 1
    return changed


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.linear_method = DEFAULT_LINEAR_METHOD
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=weight_device()),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        copy_checked(param, narrow(loaded, 0, 0, shape_of(loaded)[0]), "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Y = X W^T with W's rows (outputs) split across TP ranks; outputs stay split."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp_size, self.tp_rank = ps.get_tp_size(), ps.get_tp_rank()
        self.out_per_rank = _divide(out_features, self.tp_size, "output size")
        super().__init__(in_features, self.out_per_rank, bias)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        rows = shape_of(loaded)[0]
        if rows != self.out_per_rank * self.tp_size:
            raise WeightShapeError(f"expected {self.out_per_rank * self.tp_size} rows, checkpoint "
                                   f"has shape {shape_of(loaded)}")
        copy_checked(param, narrow(loaded, 0, self.tp_rank * self.out_per_rank, self.out_per_rank),
                     "weight")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one weight (gate_proj + up_proj).

    Given `silu_and_mul` (a `SiluAndMul`; two outputs of one size), the layer returns
    silu(gate) * up rather than the product, through its method's `apply_silu_and_mul`."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 silu_and_mul: nn.Module | None = None):
        if silu_and_mul is not None and (len(output_sizes) != 2 or output_sizes[0] != output_sizes[1]):
            raise ValueError(f"output_sizes={output_sizes}: silu_and_mul needs two outputs of one size")
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)
        self.silu_and_mul = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu_and_mul is None:
            return self.linear_method.apply(self, x, self.bias)
        return self.linear_method.apply_silu_and_mul(self, x, self.bias, self.silu_and_mul)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        tp = self.tp_size
        size = _divide(self.output_sizes[shard_id], tp, "output size")
        offset = sum(self.output_sizes[:shard_id]) // tp
        if shape_of(loaded)[0] != self.output_sizes[shard_id]:
            raise WeightShapeError(f"expected {self.output_sizes[shard_id]} rows, checkpoint has "
                                   f"shape {shape_of(loaded)}")
        copy_checked(param.data.narrow(0, offset, size), narrow(loaded, 0, self.tp_rank * size, size),
                     f"shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks, KV heads replicated when
    there are fewer KV heads than ranks."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False):
        tp = ps.get_tp_size()
        self.head_size = head_size
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.kv_replicas = _divide(tp, num_kv_heads, "tensor_parallel_size / num_key_value_heads")
            self.num_kv_heads = 1
        self.total_kv_heads = num_kv_heads
        out = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        if shard_id == "q":
            offset, size, start = 0, q_size, self.tp_rank * q_size
            expected = q_size * self.tp_size
        else:
            offset = q_size + (kv_size if shard_id == "v" else 0)
            size, start = kv_size, (self.tp_rank // self.kv_replicas) * kv_size
            expected = self.total_kv_heads * self.head_size
        if shape_of(loaded)[0] != expected:
            raise WeightShapeError(f"expected {expected} rows for {shard_id}, checkpoint has shape "
                                   f"{shape_of(loaded)}")
        copy_checked(param.data.narrow(0, offset, size), narrow(loaded, 0, start, size),
                     f"shard {shard_id}")


class RowParallelLinear(LinearBase):
    """Y = X W^T with W's columns (inputs) split; partial outputs are all-reduced."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp_size, self.tp_rank = ps.get_tp_size(), ps.get_tp_rank()
        self.in_per_rank = _divide(in_features, self.tp_size, "input size")
        super().__init__(self.in_per_rank, out_features, bias)

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        if param.dim() == 1:  # bias: not split
            copy_checked(param, narrow(loaded, 0, 0, shape_of(loaded)[0]), "bias")
            return
        shape = shape_of(loaded)
        if len(shape) != 2 or shape[1] != self.in_per_rank * self.tp_size:
            raise WeightShapeError(f"expected {self.in_per_rank * self.tp_size} columns, "
                                   f"checkpoint has shape {shape}")
        copy_checked(param, narrow(loaded, 1, self.tp_rank * self.in_per_rank, self.in_per_rank),
                     "weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_method.apply(self, x)
        if self.tp_size > 1:  # the layout it was built for (a draft is built single-rank)
            out = ps.tp_all_reduce(out)
        return out if self.bias is None else out + self.bias
