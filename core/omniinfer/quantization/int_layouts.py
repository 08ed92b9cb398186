"""Per-layer tensor layouts of GPTQ, AWQ and compressed-tensors checkpoints, and the one layout
the Triton kernels read.

A format object (from a config's ``layer_format(name)``) says, for one linear layer of
``out_features`` x ``in_features``:

* ``tensor_specs``: the tensors a checkpoint holds for it (name suffix -> shape, dtype);
* ``dequantize``: the reference float32 weight [out, in], in plain torch;
* ``split_rules``: how each tensor splits under tensor parallelism (see :mod:`.int_sharding`;
  ``shard_plan`` gives one rank's slices);
* ``to_kernel_layout``: the weight converted, once at load, to :class:`PackedIntWeight`
  (weight-only formats) or :class:`Int8Weight` (W8A8).

The kernel layout is GPTQ's (AutoGPTQ) minus its quirks: codes packed along the input
dimension, the output dimension contiguous, so one load of a row of words feeds ``32 // bits``
input rows of a tile and a tile's columns are adjacent; zero points unpacked (a zero of 16, as
GPTQ v1 checkpoints can hold, does not fit four bits). AWQ's column-packed words and
compressed-tensors' [out, in] words are repacked into it; GPTQ's words are used as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniinfer.quantization.int_formats import AWQConfig, CTScheme, GPTQConfig
from omniinfer.quantization.int_packing import (
    awq_to_natural,
    pack_factor,
    pack_int32,
    unpack_int32,
)
from omniinfer.quantization.int_sharding import Narrow, plan_split

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
INTS = (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    required: bool = True


@dataclass(frozen=True, slots=True)
class PackedIntWeight:
    """Weight-only n-bit weights as the Triton kernels read them.

    ``w[k, n] = (code(k, n) - zero[g(k), n]) * scale[g(k), n]`` with code(k, n) bits
    ``[(k % P) * bits, ...)`` of ``qweight[k // P, n]`` (P = 32 // bits) and g(k) =
    ``g_idx[k]`` or ``k // group_size``.
    """

    qweight: torch.Tensor  # int32 [ceil(in / P), out]; rows past `in_features` hold zero codes
    scales: torch.Tensor  # [num_groups, out], float16/bfloat16/float32
    zeros: torch.Tensor | None  # [num_groups, out], scales' dtype, integral; None: 2**(bits-1)
    g_idx: torch.Tensor | None  # int32 [in]; None: contiguous groups of `group_size`
    bits: int
    group_size: int  # inputs per group (in_features when one group spans them all)
    in_features: int
    out_features: int

    def dequantize(self) -> torch.Tensor:
        """float32 [out, in]."""
        codes = unpack_int32(self.qweight, self.bits, 0, self.in_features).float()
        g = (self.g_idx.long() if self.g_idx is not None
             else torch.arange(self.in_features, device=codes.device) // self.group_size)
        zeros = (self.zeros.float()[g] if self.zeros is not None
                 else float(1 << (self.bits - 1)))
        return ((codes - zeros) * self.scales.float()[g]).t().contiguous()


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """int8 weights with a scale per output channel, as the int8 kernel reads them."""

    weight: torch.Tensor  # int8 [out, in]
    weight_scale: torch.Tensor  # float32 [out]
    input_scale: torch.Tensor | None  # float32 [1]: a static activation scale; None: per token
    quantize_activations: bool = True  # False: weight-only (W8A16)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.weight_scale[:, None]


def group_len(group_size: int, in_features: int) -> int:
    return in_features if group_size == -1 else group_size


def _check(tensors: dict, specs: dict[str, TensorSpec], where: str) -> None:
    for name, spec in specs.items():
        if name not in tensors:
            if spec.required:
                raise ValueError(f"{where}: the checkpoint has no tensor {name!r} (expected "
                                 f"shape {spec.shape}); found {sorted(tensors)}")
            continue
        t = tensors[name]
        if t.dtype not in spec.dtypes:
            raise ValueError(f"{where}: tensor {name!r} has dtype {t.dtype}; supported: "
                             f"{[str(d) for d in spec.dtypes]}")
        if tuple(t.shape) != spec.shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                             f"{spec.shape}")


class _Format:
    """What every format offers; see the module docstring."""

    method = ""
    bits = 4
    group_size = -1

    def tensor_specs(self, out_features: int, in_features: int) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def split_rules(self, split: str) -> dict[str, tuple[int, str]]:
        raise NotImplementedError

    def shard_plan(self, split: str, start: int, length: int, out_features: int,
                   in_features: int, layer: str = "") -> dict[str, Narrow | None]:
        """One rank's slice of each tensor for outputs (`split` "out", column-parallel) or
        inputs ("in", row-parallel) [start, start + length) of the full layer."""
        if split not in ("out", "in"):
            raise ValueError(f"split={split!r}; supported: 'out' (column-parallel), 'in' (row)")
        total = out_features if split == "out" else in_features
        return plan_split(self.split_rules(split), start, length, total,
                          pack=pack_factor(self.bits),
                          group=group_len(self.group_size, in_features),
                          layer=f"{layer} ({self.method})" if layer else self.method)

    def _groups(self, tensors: dict, in_features: int, g_idx_name: str | None):
        """(group of each input as int64 [in], inputs per group)."""
        gl = group_len(self.group_size, in_features)
        if g_idx_name and g_idx_name in tensors:
            return tensors[g_idx_name].long(), gl
        device = next(iter(tensors.values())).device
        return torch.arange(in_features, device=device) // gl, gl


class GPTQFormat(_Format):
    """AutoGPTQ's tensors: qweight int32 [in / P, out] (codes along the input dim), qzeros int32
    [groups, out / P] (along the output dim; v1 stores zero - 1), scales [groups, out], g_idx
    int32 [in] (read only with desc_act: without it groups are contiguous, as AutoGPTQ's
    exllama kernels and vLLM assume)."""

    method = "gptq"

    def __init__(self, config: GPTQConfig):
        self.config, self.bits, self.group_size = config, config.bits, config.group_size

    def tensor_specs(self, out_features, in_features):
        pf = pack_factor(self.bits)
        if in_features % pf:
            raise ValueError(f"gptq: in_features={in_features} is not a multiple of {pf}")
        groups = -(-in_features // group_len(self.group_size, in_features))
        return {"qweight": TensorSpec((in_features // pf, out_features), (torch.int32,)),
                "qzeros": TensorSpec((groups, -(-out_features // pf)), (torch.int32,)),
                "scales": TensorSpec((groups, out_features), FLOATS),
                "g_idx": TensorSpec((in_features,), INTS, required=self.config.desc_act)}

    def split_rules(self, split):
        if split == "out":
            return {"qweight": (1, "plain"), "qzeros": (1, "packed"), "scales": (1, "plain"),
                    **({"g_idx": (0, "whole")} if self.config.desc_act else {})}
        if self.config.desc_act:  # any input may use any group: every rank keeps all groups
            return {"qweight": (0, "packed"), "g_idx": (0, "plain"), "qzeros": (0, "whole"),
                    "scales": (0, "whole")}
        per_group = "whole" if self.group_size == -1 else "groups"
        return {"qweight": (0, "packed"), "qzeros": (0, per_group), "scales": (0, per_group)}

    def _parts(self, tensors, out_features, in_features):
        codes = unpack_int32(tensors["qweight"], self.bits, 0, in_features)  # [in, out]
        zeros = unpack_int32(tensors["qzeros"], self.bits, 1, out_features)  # [groups, out]
        if self.config.checkpoint_format == "gptq":
            zeros = zeros + 1  # v1: 15 reads as 16, as AutoGPTQ's kernels read it
        g, gl = self._groups(tensors, in_features, "g_idx" if self.config.desc_act else None)
        return codes, zeros, g, gl

    def dequantize(self, tensors, out_features, in_features):
        codes, zeros, g, _ = self._parts(tensors, out_features, in_features)
        w = (codes - zeros[g]).float() * tensors["scales"].float()[g]
        return w.t().contiguous()

    def to_kernel_layout(self, tensors, out_features, in_features):
        codes, zeros, g, gl = self._parts(tensors, out_features, in_features)
        scales = tensors["scales"]
        g_idx = None
        if self.config.desc_act and not torch.equal(g, torch.arange(in_features, device=g.device) // gl):
            g_idx = g.to(torch.int32)
        return _packed(tensors["qweight"].contiguous(), scales, zeros, g_idx, self.bits, gl,
                       in_features, out_features)


class AWQFormat(_Format):
    """AutoAWQ GEMM tensors: qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8],
    both packed along the output dim in AWQ_ORDER; scales [groups, out]."""

    method = "awq"

    def __init__(self, config: AWQConfig):
        self.config, self.bits, self.group_size = config, config.bits, config.group_size

    def tensor_specs(self, out_features, in_features):
        if out_features % 8:
            raise ValueError(f"awq: out_features={out_features} is not a multiple of 8")
        groups = -(-in_features // group_len(self.group_size, in_features))
        return {"qweight": TensorSpec((in_features, out_features // 8), (torch.int32,)),
                "qzeros": TensorSpec((groups, out_features // 8), (torch.int32,)),
                "scales": TensorSpec((groups, out_features), FLOATS)}

    def split_rules(self, split):
        if split == "out":
            return {"qweight": (1, "packed"), "qzeros": (1, "packed"), "scales": (1, "plain")}
        per_group = "whole" if self.group_size == -1 else "groups"
        return {"qweight": (0, "plain"), "qzeros": (0, per_group), "scales": (0, per_group)}

    def _parts(self, tensors, out_features, in_features):
        codes = awq_to_natural(unpack_int32(tensors["qweight"], 4, 1, out_features))
        zeros = awq_to_natural(unpack_int32(tensors["qzeros"], 4, 1, out_features))
        g, gl = self._groups(tensors, in_features, None)
        return codes, zeros, g, gl

    def dequantize(self, tensors, out_features, in_features):
        codes, zeros, g, _ = self._parts(tensors, out_features, in_features)
        return ((codes - zeros[g]).float() * tensors["scales"].float()[g]).t().contiguous()

    def to_kernel_layout(self, tensors, out_features, in_features):
        codes, zeros, _, gl = self._parts(tensors, out_features, in_features)
        return _packed(pack_int32(codes, 4, 0), tensors["scales"], zeros, None, 4, gl,
                       in_features, out_features)


class CTPackedFormat(_Format):
    """compressed-tensors pack-quantized: weight_packed int32 [out, ceil(in * bits / 32)]
    (signed codes + 2**(bits-1), along the input dim), weight_scale [out, groups], when
    asymmetric weight_zero_point int32 [ceil(out * bits / 32), groups] (along the output
    dim, offset like the codes), weight_shape [2], and with actorder
    "group" weight_g_idx [in]."""

    method = "compressed-tensors"

    def __init__(self, scheme: CTScheme):
        self.scheme = scheme
        self.bits = scheme.weights.num_bits
        self.group_size = scheme.weights.group_size if scheme.weights.strategy == "group" else -1
        self.has_g_idx = scheme.weights.actorder == "group"

    def tensor_specs(self, out_features, in_features):
        pf = pack_factor(self.bits)
        groups = -(-in_features // group_len(self.group_size, in_features))
        specs = {"weight_packed": TensorSpec((out_features, -(-in_features // pf)), (torch.int32,)),
                 "weight_scale": TensorSpec((out_features, groups), FLOATS),
                 "weight_shape": TensorSpec((2,), INTS, required=False)}
        if not self.scheme.weights.symmetric:
            specs["weight_zero_point"] = TensorSpec((-(-out_features // pf), groups),
                                                    (torch.int32,))
        if self.has_g_idx:
            specs["weight_g_idx"] = TensorSpec((in_features,), INTS)
        return specs

    def split_rules(self, split):
        asym = not self.scheme.weights.symmetric
        if split == "out":
            rules = {"weight_packed": (0, "plain"), "weight_scale": (0, "plain")}
            if asym:
                rules["weight_zero_point"] = (0, "packed")
            if self.has_g_idx:
                rules["weight_g_idx"] = (0, "whole")
            return rules
        per_group = "whole" if self.group_size == -1 or self.has_g_idx else "groups"
        rules = {"weight_packed": (1, "packed"), "weight_scale": (1, per_group)}
        if asym:
            rules["weight_zero_point"] = (1, per_group)
        if self.has_g_idx:
            rules["weight_g_idx"] = (0, "plain")
        return rules

    def _parts(self, tensors, out_features, in_features):
        offset = 1 << (self.bits - 1)
        codes = unpack_int32(tensors["weight_packed"], self.bits, 1, in_features)  # [out, in]
        zp = tensors.get("weight_zero_point")
        if zp is None:
            zeros = torch.full_like(tensors["weight_scale"], offset, dtype=torch.int32)
        else:  # packed like the codes: signed zero point + offset
            zeros = unpack_int32(zp, self.bits, 0, out_features)
        g, gl = self._groups(tensors, in_features, "weight_g_idx")
        return codes, zeros, g, gl

    def dequantize(self, tensors, out_features, in_features):
        codes, zeros, g, _ = self._parts(tensors, out_features, in_features)
        return (codes - zeros[:, g]).float() * tensors["weight_scale"].float()[:, g]

    def to_kernel_layout(self, tensors, out_features, in_features):
        codes, zeros, g, gl = self._parts(tensors, out_features, in_features)
        g_idx = None
        if self.has_g_idx and not torch.equal(g, torch.arange(in_features, device=g.device) // gl):
            g_idx = g.to(torch.int32)
        return _packed(pack_int32(codes.t(), self.bits, 0), tensors["weight_scale"].t(),
                       zeros.t(), g_idx, self.bits, gl, in_features, out_features)


class CTInt8Format(_Format):
    """compressed-tensors int-quantized W8A8: weight int8 [out, in], weight_scale [out, 1]
    (channel) or [1] (tensor), and input_scale [1] when activations are quantized statically."""

    method = "compressed-tensors"
    bits = 8

    def __init__(self, scheme: CTScheme):
        self.scheme = scheme
        self.is_static = not scheme.input_activations.dynamic

    def tensor_specs(self, out_features, in_features):
        scale = (out_features, 1) if self.scheme.weights.strategy == "channel" else (1,)
        specs = {"weight": TensorSpec((out_features, in_features), (torch.int8,)),
                 "weight_scale": TensorSpec(scale, FLOATS)}
        if self.is_static:
            specs["input_scale"] = TensorSpec((1,), FLOATS)
        return specs

    def split_rules(self, split):
        channel = self.scheme.weights.strategy == "channel"
        if split == "out":
            rules = {"weight": (0, "plain"), "weight_scale": (0, "plain" if channel else "whole")}
        else:
            rules = {"weight": (1, "plain"), "weight_scale": (0, "whole")}
        if self.is_static:
            rules["input_scale"] = (0, "whole")
        return rules

    def dequantize(self, tensors, out_features, in_features):
        return tensors["weight"].float() * tensors["weight_scale"].float().reshape(-1, 1)

    def to_kernel_layout(self, tensors, out_features, in_features):
        scale = tensors["weight_scale"].float().reshape(-1).expand(out_features).contiguous()
        static = tensors["input_scale"].float().reshape(1) if self.is_static else None
        return Int8Weight(tensors["weight"].contiguous(), scale, static)


def _packed(qweight, scales, zeros, g_idx, bits, gl, in_features, out_features):
    scales = scales.contiguous()
    if bool((zeros == 1 << (bits - 1)).all()):
        zero_t = None  # symmetric: the kernels use the midpoint and read no zeros
    else:
        zero_t = zeros.to(scales.dtype).contiguous()  # integers <= 256: exact in every float
    return PackedIntWeight(qweight, scales, zero_t, g_idx, bits, gl, in_features, out_features)


def check_tensors(fmt: _Format, tensors: dict, out_features: int, in_features: int,
                  layer: str = "") -> None:
    """Raise, naming the tensor, where `tensors` (one unsplit layer) do not match `fmt`."""
    _check(tensors, fmt.tensor_specs(out_features, in_features),
           f"{layer or 'layer'} ({fmt.method}, {out_features}x{in_features})")
