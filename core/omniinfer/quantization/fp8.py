"""FP8 checkpoints: float8 e4m3 weights with float32 scales, as transformers' fine-grained FP8
(``quant_method: fp8``: Qwen3-*-FP8, DeepSeek-V3) and compressed-tensors' float-quantized schemes
(llm-compressor's FP8 and FP8_DYNAMIC: RedHat's and neuralmagic's ``*-FP8`` models) store them.

A layer's weight is ``w[r, c] = e4m3(q[r, c]) * s[r // bn, c // bk]``: a scale per block of
``bn`` x ``bk`` weights (``weight_block_size``, usually [128, 128]; the last blocks of a dimension
that is not a multiple hold fewer), one per output channel or one per tensor. The file names the
scale ``weight_scale_inv`` (fp8) or ``weight_scale`` (compressed-tensors; fp8 per tensor).

The piece (kind ``fp8:b{bk}``, or ``fp8`` for one scale a row) keeps the file's bytes, ``q`` uint8
[rows, cols], and the scales spread over rows, ``scale`` float32 [rows, ceil(cols / bk)] (bn
rows share each; 1/32 of q's bytes at bk = 128), so rows narrow anywhere (a fused layer's parts,
tensor-parallel shards) and columns at block boundaries. Its reference value is the float32
product of the e4m3 value and the scale, as transformers dequantises.

Activations stay float: a checkpoint's ``activation_scheme`` (dynamic, or static with an
``input_scale``) says how an FP8 GPU kernel would round x to e4m3; here x meets the weights
unrounded (as vLLM's weight-only FP8 path on GPUs without FP8 arithmetic does), so the products
are the dequantised weights' to float32 rounding, closer to the float model than an FP8 GEMM's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniinfer.models.layers.weights import WeightShapeError
from omniinfer.quantization.base import QuantPiece, register_format
from omniinfer.quantization.int_formats import _names, _refuse, _skipped

FAMILY = "fp8"
E4M3 = torch.float8_e4m3fn
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# the kinds the kernels declare: one scale a row, or blocks of 128-512 columns (checkpoints'
# weight_block_size is [128, 128]); a piece of another block width runs the reference
KINDS = ("fp8", "fp8:b128", "fp8:b256", "fp8:b512")


def block_of(kind: str, cols: int) -> int:
    """The columns a scale covers in a `kind` piece of `cols` columns."""
    return cols if kind == FAMILY else int(kind.split(":b", 1)[1])


def fp8_kind(block_cols: int | None) -> str:
    return FAMILY if block_cols is None else f"{FAMILY}:b{block_cols}"


def values(q: torch.Tensor) -> torch.Tensor:
    """The e4m3 values of bytes `q` as float32."""
    return q.view(E4M3).float()


def _dequantize(piece: QuantPiece) -> torch.Tensor:
    rows, cols = piece.shape
    scale = piece.tensors["scale"]
    bk = block_of(piece.kind, cols)
    return values(piece.tensors["q"]) * scale.repeat_interleave(bk, dim=1)[:, :cols]


def _narrow(piece: QuantPiece, dim: int, start, length: int | None = None) -> QuantPiece:
    q, scale = piece.tensors["q"], piece.tensors["scale"]
    rows, cols = piece.shape
    if dim == 0:
        index = start if isinstance(start, torch.Tensor) else slice(start, start + length)
        q, scale = q[index].contiguous(), scale[index].contiguous()
        return QuantPiece(piece.kind, (q.shape[0], cols), {"q": q, "scale": scale})
    bk = block_of(piece.kind, cols)
    end = start + length
    if piece.kind != FAMILY:
        if start % bk or (length % bk and end != cols):
            raise WeightShapeError(f"a {piece.kind} weight: inputs {start}..{end} cut its scale blocks of {bk} "
                                   "columns (tensor parallelism splits a row-parallel layer's inputs); use fewer ranks")
        scale = scale.narrow(1, start // bk, -(-length // bk)).contiguous()
    q = q.narrow(1, start, length).contiguous()
    return QuantPiece(piece.kind, (rows, length), {"q": q, "scale": scale})


register_format(FAMILY, _dequantize, _narrow)


def piece_of(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> QuantPiece:
    """A layer's piece from the file's e4m3 `weight` [out, in] and its `scale`: [ceil(out / bn),
    ceil(in / bk)] for `block` (bn, bk); one per row ([out] or [out, 1]); or one ([] or [1])."""
    rows, cols = weight.shape
    scale = scale.float()
    if block is not None:
        bn, bk = block
        per_row = scale.repeat_interleave(bn, dim=0)[:rows]
        if bk >= cols:
            return QuantPiece(FAMILY, (rows, cols), {"q": weight.view(torch.uint8), "scale": per_row[:, :1].contiguous()})
        return QuantPiece(fp8_kind(bk), (rows, cols), {"q": weight.view(torch.uint8), "scale": per_row.contiguous()})
    per_row = scale.reshape(-1, 1).expand(rows, 1).contiguous()
    return QuantPiece(FAMILY, (rows, cols), {"q": weight.view(torch.uint8), "scale": per_row})


E4M3_MAX = 448.0  # e4m3's largest finite value


def quantize(weight: torch.Tensor) -> QuantPiece:
    """`quantization="fp8"` on a float checkpoint: row r as e4m3 codes times scale[r] = max |w[r]|
    / 448 (float32; the codes round to nearest even, as torch's cast does). A scale per output
    channel, where vLLM's dynamic FP8 keeps one a tensor: finer, the same bytes."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    codes = torch.where(scale > 0, w / scale.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(w))
    q = codes.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return QuantPiece(FAMILY, tuple(weight.shape), {"q": q.view(torch.uint8).contiguous(), "scale": scale.contiguous()})


# ---- the checkpoints' configs and tensors ---------------------------------------------------------
def _block(value, method: str, name: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise _refuse(method, name, value, "two positive integers [rows, columns] (or none)")
    return int(value[0]), int(value[1])


@dataclass(frozen=True, slots=True)
class FP8Config:
    """transformers' fine-grained FP8 / vLLM's ``quant_method: fp8`` checkpoints."""

    block: tuple[int, int] | None = None  # weight_block_size; None: one scale a tensor
    skipped: tuple[str, ...] = ()  # modules_to_not_convert / ignored_layers

    @classmethod
    def from_dict(cls, config: dict) -> FP8Config:
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise _refuse("fp8", "fmt", fmt, ("e4m3",))
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _refuse("fp8", "activation_scheme", scheme, ("dynamic", "static"))
        scale_fmt = config.get("scale_fmt", "float") or "float"
        if scale_fmt != "float":  # (ue8m0: DeepSeek-V3.1's power-of-two scales stored as bytes)
            raise _refuse("fp8", "scale_fmt", scale_fmt, ("float",))
        skipped = _names(config.get("modules_to_not_convert"), "fp8", "modules_to_not_convert") + \
            _names(config.get("ignored_layers"), "fp8", "ignored_layers")
        return cls(_block(config.get("weight_block_size"), "fp8", "weight_block_size"), skipped)

    def layer_format(self, name: str):
        return None if _skipped(name, self.skipped) else FP8Format(self.block, "fp8")


class FP8Format:
    """One layer of an FP8 checkpoint: `weight` e4m3 [out, in] and its scale, `weight_scale_inv`
    (transformers, DeepSeek) or `weight_scale` (vLLM's per-tensor files, compressed-tensors),
    shaped by `block`, else per `strategy`: "tensor" ([] or [1]) or "channel" ([out, 1])."""

    SCALE_NAMES = ("weight_scale_inv", "weight_scale")

    def __init__(self, block: tuple[int, int] | None, method: str, strategy: str = "tensor"):
        self.block, self.method, self.strategy = block, method, strategy

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...] | None:
        """The scale's shape (None: one value, [] or [1])."""
        if self.block is not None:
            bn, bk = self.block
            return -(-out_features // bn), -(-in_features // bk)
        return (out_features, 1) if self.strategy == "channel" else None

    def tensor_specs(self, out_features: int, in_features: int) -> dict:
        from omniinfer.quantization.int_layouts import TensorSpec

        return {"weight": TensorSpec((out_features, in_features), (E4M3,))}  # (its scale: check)

    def scale_of(self, tensors: dict) -> torch.Tensor | None:
        return next((tensors[n] for n in self.SCALE_NAMES if n in tensors), None)

    def check(self, tensors: dict, out_features: int, in_features: int, where: str) -> None:
        scale, shape = self.scale_of(tensors), self.scale_shape(out_features, in_features)
        want = "one value" if shape is None else f"shape {shape}"
        if scale is None:
            raise ValueError(f"{where}: the checkpoint has no scale tensor ({' or '.join(self.SCALE_NAMES)}, "
                             f"{want}); found {sorted(tensors)}")
        if scale.dtype not in SCALE_DTYPES:
            raise ValueError(f"{where}: its scale has dtype {scale.dtype}; supported: "
                             f"{[str(d) for d in SCALE_DTYPES]}")
        if (scale.numel() != 1) if shape is None else (tuple(scale.shape) != shape):
            raise ValueError(f"{where}: its scale has shape {tuple(scale.shape)}; expected {want}")

    def dequantize(self, tensors: dict, out_features: int, in_features: int) -> torch.Tensor:
        return _dequantize(self.to_kernel_layout(tensors, out_features, in_features))

    def to_kernel_layout(self, tensors: dict, out_features: int, in_features: int) -> QuantPiece:
        return piece_of(tensors["weight"], self.scale_of(tensors), self.block)


def ct_float_format(scheme) -> FP8Format:
    """A compressed-tensors float-quantized scheme's layer format."""
    w = scheme.weights
    block = tuple(w.block_structure) if w.strategy == "block" else None
    return FP8Format(block, "compressed-tensors", w.strategy)
