"""Quantized Hugging Face checkpoints: a model's ``quantization_config`` as data.

:func:`parse_quantization_config` turns the ``quantization_config`` of a config.json into a
:class:`GPTQConfig`, :class:`AWQConfig`, :class:`CompressedTensorsConfig` (integer, or FP8
float-quantized schemes) or an FP8 one (``quant_method: fp8``, :mod:`.fp8`), each validated as
it is made (a bad field is named with its value and what is supported). A config's
``layer_format(name)`` says how one linear layer is stored (:mod:`.int_layouts`, :mod:`.fp8`),
or None where that layer is left in float.

The fields are the ones the producing tools write: AutoGPTQ / GPTQModel (``quantize_config``),
AutoAWQ (``quant_config``, through transformers' ``AwqConfig`` names) and compressed-tensors
(llm-compressor's ``QuantizationConfig``). Fields that only describe calibration
(``damp_percent``, ``true_sequential``, ``observer``...) are ignored; a field that would change
the tensors' meaning and is not supported is an error, never ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

GROUP_SIZES = (32, 64, 128, -1)  # -1: one group spans all inputs (a scale per output channel)
GPTQ_BITS = (4, 8)
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")  # v1 stores zero points minus one
CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
CT_FLOAT_STRATEGIES = ("channel", "tensor", "block")  # FP8 weights (quantization/fp8.py)


def _refuse(method: str, name: str, value: Any, allowed: Any) -> ValueError:
    return ValueError(f"quantization_config ({method}): {name}={value!r} is not supported; "
                      f"supported: {allowed}")


def _names(value, method: str, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise _refuse(method, name, value, "a list of module names")
    return tuple(value)


def _skipped(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether module `name` matches one of `patterns`: "re:REGEX" (re.match, as
    compressed-tensors matches), a full name, or a name's last components ("lm_head")."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


@dataclass(frozen=True, slots=True)
class GPTQConfig:
    """AutoGPTQ / GPTQModel checkpoints (``quant_method: gptq``)."""

    bits: int = 4
    group_size: int = 128  # inputs per group; -1: one group (per-channel scales)
    sym: bool = True  # the zero point is 2**(bits-1) (still stored, in qzeros)
    desc_act: bool = False  # act-order: g_idx assigns each input its group
    checkpoint_format: str = "gptq"  # "gptq" (v1: qzeros hold zero - 1) or "gptq_v2"
    modules_to_not_convert: tuple[str, ...] = ()  # float layers besides lm_head
    lm_head: bool = False  # whether the LM head is quantized too

    def __post_init__(self):
        if self.bits not in GPTQ_BITS:
            raise _refuse("gptq", "bits", self.bits, GPTQ_BITS)
        if self.group_size not in GROUP_SIZES:
            raise _refuse("gptq", "group_size", self.group_size, GROUP_SIZES)
        if self.checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
            raise _refuse("gptq", "checkpoint_format", self.checkpoint_format,
                          GPTQ_CHECKPOINT_FORMATS)
        for name in ("sym", "desc_act", "lm_head"):
            if not isinstance(getattr(self, name), bool):
                raise _refuse("gptq", name, getattr(self, name), "true or false")

    @classmethod
    def from_dict(cls, config: dict) -> GPTQConfig:
        pack_dtype = config.get("pack_dtype", "int32")
        if str(pack_dtype).removeprefix("torch.") != "int32":
            raise _refuse("gptq", "pack_dtype", pack_dtype, "int32")
        if config.get("dynamic"):  # GPTQModel's per-module bits/group overrides
            raise _refuse("gptq", "dynamic", config["dynamic"], "none (one scheme for all layers)")
        fmt = config.get("checkpoint_format", config.get("format", "gptq"))
        return cls(bits=config.get("bits", 4), group_size=config.get("group_size", 128),
                   sym=config.get("sym", True), desc_act=config.get("desc_act", False),
                   checkpoint_format=fmt, lm_head=config.get("lm_head", False),
                   modules_to_not_convert=_names(config.get("modules_to_not_convert"), "gptq",
                                                 "modules_to_not_convert"))

    def layer_format(self, name: str):
        """How the linear layer `name` is stored (None: it is float)."""
        from omniinfer.quantization.int_layouts import GPTQFormat

        if _skipped(name, self.modules_to_not_convert) or (
                not self.lm_head and _skipped(name, ("lm_head",))):
            return None
        return GPTQFormat(self)


@dataclass(frozen=True, slots=True)
class AWQConfig:
    """AutoAWQ checkpoints in the GEMM layout (``quant_method: awq``, ``version: gemm``)."""

    bits: int = 4
    group_size: int = 128
    zero_point: bool = True  # asymmetric: a zero point per group and output
    version: str = "gemm"
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self):
        if self.bits != 4:
            raise _refuse("awq", "bits", self.bits, (4,))
        if self.group_size not in GROUP_SIZES:
            raise _refuse("awq", "group_size", self.group_size, GROUP_SIZES)
        if self.zero_point is not True:  # AutoAWQ's GEMM kernels always read zero points
            raise _refuse("awq", "zero_point", self.zero_point, (True,))
        if self.version != "gemm":  # GEMV and the Marlin/exllama exports lay words out otherwise
            raise _refuse("awq", "version", self.version, ("gemm",))

    @classmethod
    def from_dict(cls, config: dict) -> AWQConfig:
        version = config.get("version", "gemm")
        return cls(bits=config.get("bits", config.get("w_bit", 4)),
                   group_size=config.get("group_size", config.get("q_group_size", 128)),
                   zero_point=config.get("zero_point", True),
                   version=version.lower() if isinstance(version, str) else version,
                   modules_to_not_convert=_names(config.get("modules_to_not_convert"), "awq",
                                                 "modules_to_not_convert"))

    def layer_format(self, name: str):
        from omniinfer.quantization.int_layouts import AWQFormat

        if _skipped(name, self.modules_to_not_convert + ("lm_head",)):
            return None
        return AWQFormat(self)


@dataclass(frozen=True, slots=True)
class CTWeights:
    """compressed-tensors' ``weights`` arguments of one scheme."""

    num_bits: int
    symmetric: bool = True
    strategy: str = "group"  # "group", "channel" (or "tensor" for int8 W8A8)
    group_size: int | None = None
    actorder: str | None = None  # "group": checkpoints hold weight_g_idx; "weight": they do not
    type: str = "int"  # "float": FP8 (e4m3) weights
    block_structure: tuple[int, int] | None = None  # strategy "block": [rows, columns] a scale


@dataclass(frozen=True, slots=True)
class CTActivations:
    """``input_activations``: int8, symmetric, per token (dynamic) or per tensor (static); with
    FP8 weights, float8 (not applied here: quantization/fp8.py says why)."""

    num_bits: int = 8
    symmetric: bool = True
    strategy: str = "token"
    dynamic: bool = True
    type: str = "int"


@dataclass(frozen=True, slots=True)
class CTScheme:
    """One of a compressed-tensors config's ``config_groups``."""

    name: str
    targets: tuple[str, ...]  # "Linear", "re:REGEX" or module names
    weights: CTWeights
    input_activations: CTActivations | None
    format: str  # "pack-quantized" (W4A16/W8A16) or "int-quantized" (W8A8)

    def __post_init__(self):
        where = f"compressed-tensors, config_groups.{self.name}"
        w, a = self.weights, self.input_activations
        if self.format not in CT_FORMATS:
            raise _refuse(where, "format", self.format, CT_FORMATS)
        if w.type == "float" or self.format == "float-quantized":
            self._check_float(where)
            return
        if self.format == "pack-quantized":
            if w.num_bits not in (4, 8):
                raise _refuse(where, "weights.num_bits", w.num_bits, (4, 8))
            if w.strategy not in ("group", "channel"):
                raise _refuse(where, "weights.strategy", w.strategy, ("group", "channel"))
            if a is not None:
                raise _refuse(where, "input_activations", "set",
                              "none with pack-quantized (weight-only)")
        else:  # int-quantized / naive-quantized: int8 weights as they are
            if w.num_bits != 8:
                raise _refuse(where, "weights.num_bits", w.num_bits, (8,))
            if w.strategy not in ("channel", "tensor"):
                raise _refuse(where, "weights.strategy", w.strategy, ("channel", "tensor"))
            if not w.symmetric:
                raise _refuse(where, "weights.symmetric", w.symmetric, (True,))
            if a is None:
                raise _refuse(where, "input_activations", None, "int8 activations (W8A8)")
            if a.num_bits != 8 or not a.symmetric:
                raise _refuse(where, "input_activations", (a.num_bits, a.symmetric),
                              "8 bits, symmetric")
            if (a.strategy, a.dynamic) not in (("token", True), ("tensor", False)):
                raise _refuse(where, "input_activations.(strategy, dynamic)",
                              (a.strategy, a.dynamic), "(token, dynamic) or (tensor, static)")
        if w.strategy == "group" and w.group_size not in GROUP_SIZES[:-1]:
            raise _refuse(where, "weights.group_size", w.group_size, GROUP_SIZES[:-1])
        if w.actorder not in (None, "weight", "group"):
            raise _refuse(where, "weights.actorder", w.actorder, (None, "weight", "group"))
        if w.actorder == "group" and w.strategy != "group":
            raise _refuse(where, "weights.actorder", w.actorder, "group only with strategy group")

    def _check_float(self, where: str) -> None:
        """FP8 weights (float-quantized; llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK)."""
        w, a = self.weights, self.input_activations
        if w.type != "float" or w.num_bits != 8:
            raise _refuse(where, "weights.(type, num_bits)", (w.type, w.num_bits), "('float', 8) with float-quantized")
        if self.format not in ("float-quantized", "naive-quantized"):
            raise _refuse(where, "format", self.format, ("float-quantized", "naive-quantized"))
        if w.strategy not in CT_FLOAT_STRATEGIES:
            raise _refuse(where, "weights.strategy", w.strategy, CT_FLOAT_STRATEGIES)
        if not w.symmetric:
            raise _refuse(where, "weights.symmetric", w.symmetric, (True,))
        if w.strategy == "block" and (w.block_structure is None or len(w.block_structure) != 2
                                      or not all(isinstance(v, int) and v > 0 for v in w.block_structure)):
            raise _refuse(where, "weights.block_structure", w.block_structure, "[rows, columns] with strategy block")
        if a is not None and (a.type != "float" or a.num_bits != 8):
            raise _refuse(where, "input_activations.(type, num_bits)", (a.type, a.num_bits),
                          "('float', 8) or none with FP8 weights")

    @classmethod
    def from_dict(cls, name: str, group: dict, default_format: str | None) -> CTScheme:
        where = f"compressed-tensors, config_groups.{name}"
        weights, acts = group.get("weights"), group.get("input_activations")
        if not isinstance(weights, dict):
            raise _refuse(where, "weights", weights, "integer weight arguments")
        wtype = weights.get("type", "int")
        if wtype not in ("int", "float"):
            raise _refuse(where, "weights.type", wtype, ("int", "float"))
        if weights.get("dynamic", False):
            raise _refuse(where, "weights.dynamic", weights["dynamic"], (False,))
        group_size = weights.get("group_size")
        strategy = weights.get("strategy") or ("group" if group_size and group_size > 0
                                               else "channel" if group_size == -1 else "tensor")
        actorder = weights.get("actorder")
        actorder = {"static": "weight", "dynamic": "group", True: "group", False: None}.get(
            actorder, actorder)
        ct_acts = None
        if acts is not None:
            atype = acts.get("type", "int")
            if atype not in ("int", "float"):
                raise _refuse(where, "input_activations.type", atype, ("int", "float"))
            ct_acts = CTActivations(acts.get("num_bits", 8), acts.get("symmetric", True),
                                    acts.get("strategy") or "tensor", bool(acts.get("dynamic")), atype)
        fmt = group.get("format") or default_format
        if fmt is None:
            fmt = "float-quantized" if wtype == "float" else "pack-quantized" if acts is None else "int-quantized"
        block = weights.get("block_structure")
        return cls(name, _names(group.get("targets"), where, "targets"),
                   CTWeights(weights.get("num_bits", 8), weights.get("symmetric", True),
                             strategy, group_size, actorder, wtype,
                             tuple(block) if isinstance(block, (list, tuple)) else block), ct_acts, fmt)


@dataclass(frozen=True, slots=True)
class CompressedTensorsConfig:
    """compressed-tensors checkpoints (``quant_method: compressed-tensors``), compressed."""

    schemes: tuple[CTScheme, ...]
    ignore: tuple[str, ...] = ("lm_head",)
    quantization_status: str = "compressed"

    def __post_init__(self):
        if not self.schemes:
            raise _refuse("compressed-tensors", "config_groups", {}, "at least one scheme")
        if self.quantization_status != "compressed":  # "frozen" weights are fake-quantized floats
            raise _refuse("compressed-tensors", "quantization_status", self.quantization_status,
                          ("compressed",))

    @classmethod
    def from_dict(cls, config: dict) -> CompressedTensorsConfig:
        for key in ("sparsity_config", "kv_cache_scheme", "transform_config"):
            if config.get(key):
                raise _refuse("compressed-tensors", key, "set", "none")
        top = config.get("format")
        groups = config.get("config_groups") or {}
        schemes = tuple(CTScheme.from_dict(name, group, None if top == "mixed-precision" else top)
                        for name, group in groups.items())
        return cls(schemes, _names(config.get("ignore"), "compressed-tensors", "ignore"),
                   config.get("quantization_status", "compressed"))

    def scheme_for(self, name: str, module_type: str = "Linear") -> CTScheme | None:
        """The scheme that quantizes module `name` (first matching group), None if ignored."""
        if _skipped(name, self.ignore):
            return None
        for scheme in self.schemes:
            if module_type in scheme.targets or _skipped(name, scheme.targets):
                return scheme
        return None

    def layer_format(self, name: str):
        from omniinfer.quantization.int_layouts import CTInt8Format, CTPackedFormat

        scheme = self.scheme_for(name)
        if scheme is None:
            return None
        if scheme.weights.type == "float":
            from omniinfer.quantization.fp8 import ct_float_format

            return ct_float_format(scheme)
        return CTPackedFormat(scheme) if scheme.format == "pack-quantized" else CTInt8Format(scheme)


IntQuantConfig = GPTQConfig | AWQConfig | CompressedTensorsConfig


def _fp8(config: dict):
    from omniinfer.quantization.fp8 import FP8Config

    return FP8Config.from_dict(config)


_PARSERS = {"gptq": GPTQConfig.from_dict, "awq": AWQConfig.from_dict,
            "compressed-tensors": CompressedTensorsConfig.from_dict, "fp8": _fp8}


def parse_quantization_config(config: dict) -> IntQuantConfig:
    """A config.json's ``quantization_config`` as a validated config."""
    if not isinstance(config, dict):
        raise TypeError(f"quantization_config must be a dict, got {type(config).__name__}")
    method = str(config.get("quant_method", "")).lower().replace("_", "-")
    if method not in _PARSERS:
        raise _refuse("quantization_config", "quant_method", config.get("quant_method"),
                      sorted(_PARSERS))
    return _PARSERS[method](config)


__all__ = ["AWQConfig", "CTActivations", "CTScheme", "CTWeights", "CompressedTensorsConfig",
           "GPTQConfig", "IntQuantConfig", "parse_quantization_config"]
