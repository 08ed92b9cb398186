"""GPTQ, AWQ, compressed-tensors and FP8 checkpoints as the quantisation contract's pieces (base.py).

Each quantised linear layer of such a checkpoint is converted once, at load, to one of two
layouts, whatever format it came in:

* ``wint{4,8}``: weight-only n-bit, :class:`~.int_layouts.PackedIntWeight` (codes packed along the
  input dim, the output dim contiguous, zero points unpacked). The kind names what changes the
  arithmetic: ``wint4:g128`` (symmetric, groups of 128 inputs), ``wint4:gc:zp`` (one group per
  output channel, zero points), ``wint8:g32:act`` (act-order: a g_idx assigns each input its
  group).
* ``w8a8`` / ``w8a8:static``: compressed-tensors int8 weights with a scale per output channel,
  whose activations are quantised to int8 per token (or with the checkpoint's static scale).
* ``fp8`` / ``fp8:b128``: FP8 checkpoints' e4m3 bytes as they are, with their scales
  (quantization/fp8.py).

A piece's rows are the layer's outputs and its columns its inputs, as for every format, so a
fused layer's parts and tensor-parallel shards narrow here (an input split must fall on a packed
word and, without act-order, on a group). The loader reads a layer's tensors once and hands the
model's weight loaders a :class:`IntCheckpointTensor` standing in for ``<layer>.weight``.
"""

from __future__ import annotations

import torch

from omniinfer.logger import init_logger
from omniinfer.models.layers.weights import WeightShapeError
from omniinfer.quantization.base import QuantPiece, register_format
from omniinfer.quantization.int_formats import parse_quantization_config
from omniinfer.quantization.int_layouts import (
    CTInt8Format,
    CTPackedFormat,
    GPTQFormat,
    Int8Weight,
    PackedIntWeight,
    check_tensors,
)
from omniinfer.quantization.int_packing import pack_factor

logger = init_logger(__name__)
METHODS = ("gptq", "awq", "compressed-tensors", "fp8")  # quant_method values these checkpoints carry
# every weight-only kind wint_kind() names (groups: int_formats.GROUP_SIZES; "gc" is one group)
WINT_KINDS = tuple(f"wint{bits}:{group}{extra}" for bits in (4, 8) for group in ("g32", "g64", "g128", "gc")
                   for extra in ("", ":zp", ":act", ":zp:act"))


# ---- the weight-only layout ---------------------------------------------------------------------
def wint_kind(w: PackedIntWeight, group_size: int) -> str:
    group = "gc" if group_size == -1 else f"g{group_size}"
    return (f"wint{w.bits}:{group}" + (":zp" if w.zeros is not None else "")
            + (":act" if w.g_idx is not None else ""))


def parse_wint(kind: str) -> tuple[int, int | None, bool, bool]:
    """(bits, group size or None for one group, has zero points, has g_idx) of a wint kind."""
    parts = kind.split(":")
    bits = int(parts[0][4:])
    group = None if parts[1] == "gc" else int(parts[1][1:])
    return bits, group, "zp" in parts, "act" in parts


def wint_piece(w: PackedIntWeight, group_size: int) -> QuantPiece:
    tensors = {"qweight": w.qweight, "scales": w.scales}
    if w.zeros is not None:
        tensors["zeros"] = w.zeros
    if w.g_idx is not None:
        tensors["g_idx"] = w.g_idx
    return QuantPiece(wint_kind(w, group_size), (w.out_features, w.in_features), tensors)


def packed_weight(piece: QuantPiece) -> PackedIntWeight:
    bits, group, _, _ = parse_wint(piece.kind)
    rows, cols = piece.shape
    t = piece.tensors
    return PackedIntWeight(t["qweight"], t["scales"], t.get("zeros"), t.get("g_idx"), bits,
                           cols if group is None else group, cols, rows)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A narrowed tensor with its own storage (a rank keeps only its part of the layer)."""
    return t.clone(memory_format=torch.contiguous_format)


def _narrow_wint(piece: QuantPiece, dim: int, start, length: int | None = None) -> QuantPiece:
    bits, group, _, act = parse_wint(piece.kind)
    rows, cols = piece.shape
    t = dict(piece.tensors)
    if dim == 0:  # outputs: the columns of every [.., out] tensor
        index = (start if isinstance(start, torch.Tensor)
                 else torch.arange(start, start + length, device=t["qweight"].device))
        for name in ("qweight", "scales", "zeros"):
            if name in t:
                t[name] = t[name].index_select(1, index.to(torch.long))
        return QuantPiece(piece.kind, (index.numel(), cols), t)
    end = start + length
    pf = pack_factor(bits)
    if start % pf or (length % pf and end != cols):
        raise WeightShapeError(f"a {piece.kind} weight: inputs {start}..{end} cut its packed words of "
                               f"{pf} codes (tensor parallelism splits a row-parallel layer's inputs); "
                               "use fewer ranks")
    t["qweight"] = _owned(t["qweight"].narrow(0, start // pf, -(-length // pf)))
    if act:
        t["g_idx"] = _owned(t["g_idx"].narrow(0, start, length))  # every group stays
    elif group is not None:
        if start % group or (length % group and end != cols):
            raise WeightShapeError(f"a {piece.kind} weight: inputs {start}..{end} cut its groups of "
                                   f"{group} (tensor parallelism splits a row-parallel layer's "
                                   "inputs); use fewer ranks")
        for name in ("scales", "zeros"):
            if name in t:
                t[name] = _owned(t[name].narrow(0, start // group, -(-length // group)))
    return QuantPiece(piece.kind, (rows, length), t)


def _concat_wint(a: QuantPiece, b: QuantPiece) -> QuantPiece | None:
    """Two pieces' outputs side by side; pieces whose inputs map to groups differently (each part
    of a fused act-order layer has its own g_idx) stay apart."""
    if "g_idx" in a.tensors and not torch.equal(a.tensors["g_idx"], b.tensors["g_idx"]):
        return None
    t = {k: torch.cat([a.tensors[k], b.tensors[k]], dim=1) for k in ("qweight", "scales", "zeros") if k in a.tensors}
    if "g_idx" in a.tensors:
        t["g_idx"] = a.tensors["g_idx"]
    return QuantPiece(a.kind, (a.shape[0] + b.shape[0], a.shape[1]), t)


register_format("wint4", lambda p: packed_weight(p).dequantize(), _narrow_wint, _concat_wint)
register_format("wint8", lambda p: packed_weight(p).dequantize(), _narrow_wint, _concat_wint)


# ---- int8 weights and activations (compressed-tensors W8A8) --------------------------------------
def w8a8_piece(w: Int8Weight) -> QuantPiece:
    tensors = {"q": w.weight, "scale": w.weight_scale}
    if w.input_scale is not None:
        tensors["input_scale"] = w.input_scale
    return QuantPiece("w8a8:static" if w.input_scale is not None else "w8a8",
                      tuple(w.weight.shape), tensors)


def int8_weight(piece: QuantPiece) -> Int8Weight:
    t = piece.tensors
    return Int8Weight(t["q"], t["scale"], t.get("input_scale"))


def _narrow_w8a8(piece: QuantPiece, dim: int, start, length: int | None = None) -> QuantPiece:
    t = dict(piece.tensors)
    if dim == 0:
        rows = start if isinstance(start, torch.Tensor) else slice(start, start + length)
        t["q"], t["scale"] = _owned(t["q"][rows]), _owned(t["scale"][rows])
    else:
        t["q"] = _owned(t["q"].narrow(1, start, length))
    return QuantPiece(piece.kind, tuple(t["q"].shape), t)


def _concat_w8a8(a: QuantPiece, b: QuantPiece) -> QuantPiece | None:
    if "input_scale" in a.tensors and not torch.equal(a.tensors["input_scale"], b.tensors["input_scale"]):
        return None  # (each part quantises its activations with its own static scale)
    t = {k: torch.cat([a.tensors[k], b.tensors[k]]) for k in ("q", "scale")}
    if "input_scale" in a.tensors:
        t["input_scale"] = a.tensors["input_scale"]
    return QuantPiece(a.kind, (a.shape[0] + b.shape[0], a.shape[1]), t)


register_format("w8a8", lambda p: int8_weight(p).dequantize(), _narrow_w8a8, _concat_w8a8)


# ---- reading a checkpoint -----------------------------------------------------------------------
class IntCheckpointTensor:
    """`<layer>.weight` of a quantised layer: its format's tensors, converted on first use; shape
    [out, in] like the float weight, `narrow` a QuantPiece of those outputs or inputs."""

    def __init__(self, name: str, fmt, tensors: dict, shape: tuple[int, int]):
        self.name, self.fmt, self.shape = name, fmt, shape
        self._tensors = tensors  # suffix -> a lazily read CheckpointTensor
        self._piece: QuantPiece | None = None

    def full(self) -> QuantPiece:
        if self._piece is None:
            out, inp = self.shape
            tensors = {k: v.full() for k, v in self._tensors.items()}
            layer = self.name.removesuffix(".weight")
            check_tensors(self.fmt, tensors, out, inp, layer)
            if hasattr(self.fmt, "check"):  # (FP8: a scale for the tensor, [] or [1])
                self.fmt.check(tensors, out, inp, f"{layer} ({self.fmt.method}, {out}x{inp})")
            layout = self.fmt.to_kernel_layout(tensors, out, inp)
            self._piece = (layout if isinstance(layout, QuantPiece) else w8a8_piece(layout)
                           if isinstance(layout, Int8Weight) else wint_piece(layout, self.fmt.group_size))
        return self._piece

    def narrow(self, dim: int, start: int, length: int) -> QuantPiece:
        from omniinfer.quantization.base import narrow_piece

        return narrow_piece(self.full(), dim, start, length)


def _features(fmt, tensors: dict) -> tuple[int, int]:
    """(out, in) of one layer from its tensors' shapes."""
    if isinstance(fmt, CTInt8Format) or "weight" in tensors:  # (int8 and FP8 weights as they are)
        return tuple(tensors["weight"].shape)
    if isinstance(fmt, CTPackedFormat):
        if "weight_shape" in tensors:
            out, inp = (int(v) for v in tensors["weight_shape"].full().tolist())
            return out, inp
        packed = tensors["weight_packed"].shape
        return packed[0], tensors["weight_g_idx"].shape[0] if "weight_g_idx" in tensors \
            else packed[1] * pack_factor(fmt.bits)
    out = tensors["scales"].shape[1]
    if isinstance(fmt, GPTQFormat):
        rows = tensors["qweight"].shape[0]
        return out, tensors["g_idx"].shape[0] if "g_idx" in tensors else rows * pack_factor(fmt.bits)
    return out, tensors["qweight"].shape[0]  # AWQ: qweight [in, out / 8]


_MAIN = {"qweight": ("gptq", "awq"), "weight_packed": ("compressed-tensors",)}
_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
             "weight_zero_point", "weight_shape", "weight_g_idx", "input_scale", "weight_scale_inv")


def _layers(method: str, names: set[str]) -> set[str]:
    """The prefixes of the quantised layers among a checkpoint's tensor names."""
    layers = set()
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        if (suffix in _MAIN and method in _MAIN[suffix]) or (
                method in ("compressed-tensors", "fp8") and suffix in ("weight_scale", "weight_scale_inv")
                and f"{prefix}.weight" in names and f"{prefix}.weight_packed" not in names):
            layers.add(prefix)
    return layers


def int_checkpoint(quantization_config: dict, files: list[str], progress: bool = True):
    """The checkpoint in `files` with each quantised layer's tensors replaced by one
    `<layer>.weight` (IntCheckpointTensor), and the names of those; float tensors pass through
    as they are read. A quantised layer's tensors (its quantised bytes) are read as they come and
    the layer is handed on once the files are read (its parts may lie in different shards)."""
    from omniinfer.models.loader import checkpoint_names, iterate_checkpoint

    config = parse_quantization_config(quantization_config)
    method = str(quantization_config.get("quant_method")).lower().replace("_", "-")
    layers = _layers(method, checkpoint_names(files))
    formats = {}
    for prefix in layers:
        fmt = config.layer_format(prefix)
        if fmt is None:
            raise ValueError(f"{prefix}: the checkpoint stores it quantised, but its quantization_config "
                             "leaves it in float (modules_to_not_convert / ignore)")
        formats[prefix] = fmt

    def tensors():
        parts: dict[str, dict] = {prefix: {} for prefix in layers}
        kv_scales = []
        for name, t in iterate_checkpoint(files, progress):
            prefix, _, suffix = name.rpartition(".")
            if method == "fp8" and is_kv_scale(prefix, suffix):
                kv_scales.append(name)
                continue
            if prefix in layers and (suffix in _SUFFIXES or suffix == "weight"):
                if isinstance(formats[prefix], GPTQFormat) and suffix == "g_idx" \
                        and not formats[prefix].config.desc_act:
                    continue  # (written by AutoGPTQ, read only with desc_act)
                parts[prefix][suffix] = _Read(t.full())
            else:
                yield name, t
        for prefix in sorted(layers):
            name = f"{prefix}.weight"
            fmt, got = formats[prefix], parts.pop(prefix)
            yield name, IntCheckpointTensor(name, fmt, got, _features(fmt, got))
        if kv_scales:
            logger.info("%d KV-cache scales (%s, ...) left unread: they are for an fp8 KV cache; this one holds "
                        "the model's dtype (kv_cache_dtype='auto')", len(kv_scales), kv_scales[0])

    return tensors(), {f"{prefix}.weight" for prefix in layers}


def is_kv_scale(prefix: str, suffix: str) -> bool:
    """An FP8 checkpoint's attention scales for an fp8 KV cache (`self_attn.k_scale`, older files'
    `self_attn.k_proj.output_scale`), which vLLM reads only when its cache is fp8."""
    return suffix in ("k_scale", "v_scale", "q_scale", "prob_scale") or (
        suffix == "output_scale" and prefix.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj"))


class _Read:
    """A tensor already read, with CheckpointTensor's face (`shape`, `full`)."""

    def __init__(self, t: torch.Tensor):
        self.t, self.shape = t, tuple(t.shape)

    def full(self) -> torch.Tensor:
        return self.t
