"""How a layer holds and applies a quantised weight: the contract every format and platform meets.

* A quantised linear layer (or embedding, or LM head) keeps no float weight: its `weight`
  parameter is on the meta device (the shape and dtype the model expects, no storage) and its
  `qweight` is a :class:`QuantizedWeight`: row segments, each one format's tensors for a range of
  the layer's output rows (a fused qkv or gate_up layer whose parts a file stores in different
  formats is several segments).
* Loading goes through the layer's own `weight_loader`, unchanged: it narrows the checkpoint
  tensor to this rank's rows (or, row-parallel, columns) and copies into `weight`. For a
  quantised layer that target is a :class:`QuantSlot`, which accepts the narrowed
  :class:`QuantPiece` (a format's tensors for those rows); so a quantised weight shards under
  tensor parallelism exactly as a float one does, and a format only says how its tensors narrow
  (a column split must fall on a block boundary; it says so when it does not).
* Applying is the layer's `linear_method`, a :class:`QuantLinearMethod`: for each segment the
  platform's kernel for that format (a :class:`QuantKernel` a plugin declares through the hook
  `omniinfer_quantization_kernels`), else the reference: dequantise the segment, in slices of
  rows, and multiply with torch, so the float copy lives only for the slice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from omniinfer.logger import init_logger
from omniinfer.models.layers.linear import LinearMethod
from omniinfer.models.layers.weights import WeightShapeError

logger = init_logger(__name__)
REFERENCE_SLICE_BYTES = 64 << 20  # the reference dequantises at most this many float bytes at once
# the Triton layers' dequantised weight past a few rows (kernels/triton/dequant_linear.py): at most
# this many bytes live at once; the accelerators' KV budget keeps room for it (platforms/interface.py)
DEQUANT_WORKSPACE_BYTES = 256 << 20


@dataclass(slots=True)
class QuantPiece:
    """Some rows of a quantised tensor: `kind` names the format ("gguf:Q4_K", "int8"), `shape` is
    the float weight's [rows, cols], `tensors` what the format stores for them (rows first)."""

    kind: str
    shape: tuple[int, int]
    tensors: dict[str, torch.Tensor]

    def dim(self) -> int:
        return 2


@dataclass(slots=True)
class Segment:
    row0: int  # the first output row of the layer it covers
    piece: QuantPiece
    kernel: QuantKernel | None = None  # the platform's, once a linear method chose it (else None)

    @property
    def rows(self) -> int:
        return self.piece.shape[0]

    def rows_of(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Float rows `ids` (local) of this segment: its kernel's lookup where it has one, else
        the format's own narrow and dequantise."""
        if self.kernel is not None:
            rows = self.kernel.rows(ids, dtype)
            if rows is not None:
                return rows
        return dequantize_piece(narrow_piece(self.piece, 0, ids)).to(dtype)


class QuantizedWeight:
    """A layer's quantised weight: segments covering its [rows, cols] in row order."""

    def __init__(self, shape: tuple[int, int], segments: list[Segment]):
        self.shape = shape
        self.segments = segments

    @property
    def kinds(self) -> list[str]:
        return sorted({s.piece.kind for s in self.segments})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.segments for t in s.piece.tensors.values())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole float weight (tests and tools; the layers never hold it)."""
        return torch.cat([dequantize_piece(s.piece).to(dtype) for s in self.segments], dim=0)

    def rows_of(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Float rows `ids` (an embedding lookup): only those rows are dequantised."""
        if len(self.segments) == 1 and self.segments[0].row0 == 0:  # (one table: no masks)
            return self.segments[0].rows_of(ids, dtype)
        out = torch.empty(ids.numel(), self.shape[1], dtype=dtype, device=ids.device)
        for s in self.segments:
            hit = (ids >= s.row0) & (ids < s.row0 + s.rows)
            if bool(hit.any()):
                out[hit] = s.rows_of(ids[hit] - s.row0, dtype)
        return out


# ---- formats ------------------------------------------------------------------------------------
_DEQUANTIZERS: dict[str, Callable[[QuantPiece], torch.Tensor]] = {}
_NARROWERS: dict[str, Callable[[QuantPiece, int, object, int | None], QuantPiece]] = {}
_CONCATS: dict[str, Callable[[QuantPiece, QuantPiece], QuantPiece | None]] = {}


def _concat_rows(a: QuantPiece, b: QuantPiece) -> QuantPiece:
    tensors = {k: torch.cat([a.tensors[k], b.tensors[k]]) for k in a.tensors}
    return QuantPiece(a.kind, (a.shape[0] + b.shape[0], a.shape[1]), tensors)


def register_format(prefix: str, dequantize: Callable, narrow: Callable, concat: Callable = _concat_rows) -> None:
    """A format family (kinds "prefix:..." or "prefix"): how to dequantise a piece to float32,
    how to take rows (dim 0: a start and length, or an index tensor) or columns (dim 1), and how
    to join two pieces' rows (a fused layer's parts; None where they cannot be one piece)."""
    _DEQUANTIZERS[prefix] = dequantize
    _NARROWERS[prefix] = narrow
    _CONCATS[prefix] = concat


# the module that registers each family (imported on first use)
FORMAT_MODULES = {"gguf": "omniinfer.quantization.gguf_file", "int8": "omniinfer.quantization.int8",
                  "fp8": "omniinfer.quantization.fp8",
                  **dict.fromkeys(("wint4", "wint8", "w8a8"), "omniinfer.quantization.int_pieces")}


def _family(kind: str) -> str:
    family = kind.split(":", 1)[0]
    if family not in _DEQUANTIZERS and family in FORMAT_MODULES:
        import importlib

        importlib.import_module(FORMAT_MODULES[family])
    if family not in _DEQUANTIZERS:
        raise ValueError(f"quantised format {kind!r} is unknown; known: {', '.join(sorted(FORMAT_MODULES))}")
    return family


def dequantize_piece(piece: QuantPiece) -> torch.Tensor:
    return _DEQUANTIZERS[_family(piece.kind)](piece)


def narrow_piece(piece: QuantPiece, dim: int, start, length: int | None = None) -> QuantPiece:
    return _NARROWERS[_family(piece.kind)](piece, dim, start, length)


# ---- loading: the slot a layer's weight_loader copies into ---------------------------------------
class QuantSlot:
    """Stands in for a quantised layer's float weight while it loads: `narrow` and `copy_` as a
    tensor's, but what is copied in is kept as a QuantPiece (or, for a float part of a fused layer
    in a quantised file, as the float tensor it is)."""

    def __init__(self, shape: tuple[int, int], name: str, row0: int = 0, parent: QuantSlot | None = None):
        self.shape, self.name, self.row0 = tuple(shape), name, row0
        self._parent = parent
        self._segments: list[Segment] = [] if parent is None else parent._segments

    @property
    def data(self) -> QuantSlot:
        return self

    def dim(self) -> int:
        return 2

    def __getitem__(self, rows: slice) -> QuantSlot:  # (the embedding's loader: weight.data[:n])
        start, stop, _ = rows.indices(self.shape[0])
        return self.narrow(0, start, stop - start)

    def narrow(self, dim: int, start: int, length: int) -> QuantSlot:
        if dim != 0:
            raise WeightShapeError(f"{self.name}: a quantised weight takes whole rows")
        return QuantSlot((length, self.shape[1]), self.name, self.row0 + start, self)

    def copy_(self, value) -> None:
        if not isinstance(value, QuantPiece):
            value = float_piece(torch.as_tensor(value))
        self._segments.append(Segment(self.row0, value))

    def finish(self, rows: int | None = None, device: torch.device | None = None) -> QuantizedWeight:
        """The loaded weight, its pieces on `device` (where given); raises when the pieces do not
        cover its first `rows` (default: all) exactly once (an embedding's padding rows past the
        vocabulary are never loaded)."""
        segments = sorted(self._segments, key=lambda s: s.row0)
        at = 0
        for s in segments:
            if s.row0 != at:
                break
            at += s.rows
        want = self.shape[0] if rows is None else rows
        if at != want or len({s.row0 for s in segments}) != len(segments):
            raise WeightShapeError(f"{self.name}: the checkpoint's pieces cover rows "
                                   f"{[(s.row0, s.row0 + s.rows) for s in segments]}, not 0..{self.shape[0]}")
        self._segments.clear()  # (the slot may outlive loading: a fused layer's parts, joined, go now)
        merged = _merge(segments)
        if device is not None:
            for s in merged:
                s.piece = piece_to(s.piece, device)
        return QuantizedWeight(self.shape, merged)


def _merge(segments: list[Segment]) -> list[Segment]:
    """Adjacent segments of one kind (a fused layer's parts, all Q4_K) as one."""
    out: list[Segment] = []
    for s in segments:
        prev = out[-1] if out else None
        joined = None
        if prev is not None and prev.piece.kind == s.piece.kind and prev.piece.tensors.keys() == s.piece.tensors.keys():
            joined = _CONCATS[_family(s.piece.kind)](prev.piece, s.piece)
        if joined is not None:
            out[-1] = Segment(prev.row0, joined)
        else:
            out.append(s)
    return out


def piece_to(piece: QuantPiece, device: torch.device) -> QuantPiece:
    """`piece` with its tensors on `device` (itself where they already are there)."""
    if all(t.device == device for t in piece.tensors.values()):
        return piece
    return QuantPiece(piece.kind, piece.shape, {k: t.to(device) for k, t in piece.tensors.items()})


def float_piece(t: torch.Tensor) -> QuantPiece:
    return QuantPiece("float", tuple(t.shape), {"weight": t})


def _float_narrow(piece: QuantPiece, dim: int, start, length):
    w = piece.tensors["weight"]
    part = w[start] if isinstance(start, torch.Tensor) else w.narrow(dim, start, length)
    return float_piece(part)


register_format("float", lambda p: p.tensors["weight"].float(), _float_narrow)


# ---- applying ---------------------------------------------------------------------------------
class QuantKernel:
    """A platform's native product for some formats. Subclasses set the class attributes; an
    instance is made per segment at load (its repacked state lives in it) and multiplies. A
    kernel that repacks into another format sets ``piece`` to the repacked piece (its format
    registered, so it dequantises and narrows like any other): the layer then holds that one in
    place of the original, whose memory goes.

    * ``name``: shown by `omniinfer env` and the start log.
    * ``device_types``: the torch device types it runs on.
    * ``kinds``: the formats it runs ("gguf:Q4_K", "int8", ...).
    """

    name: ClassVar[str] = ""
    device_types: ClassVar[tuple[str, ...]] = ()
    kinds: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def unavailable(cls, kind: str, shape: tuple[int, int]) -> str | None:
        """Why this kernel cannot run a `kind` weight of `shape` here (None: it can)."""
        return None

    def __init__(self, piece: QuantPiece):
        self.piece = piece

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, cols] -> x @ W^T [M, rows] in x's dtype (float32 sums)."""
        raise NotImplementedError

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Rows `ids` of its piece as float `dtype`, the values `dequantize_piece` gives (an
        embedding that shares the LM head's weight looks up through it); None: the format's
        reference does it."""
        return None

    @classmethod
    def experts_step(cls, w13: list[QuantKernel], w2: list[QuantKernel]):
        """A mixture-of-experts layer's step on this platform, for experts whose gate/up
        (`w13[e]`) and down (`w2[e]`) weights are each one kernel of this class: a callable
        (x [T, hidden], topk_weights [T, k], topk_ids [T, k]) -> [T, hidden], what
        quantization/experts.py's QuantMoEMethod computes expert by expert (it returns None for
        a call it does not take: the method's loop takes it); None: the platform has none."""
        return None


class ReferenceKernel(QuantKernel):
    """Dequantise in slices of rows, multiply with torch: any format, any device."""

    name = "reference"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        def weight_rows(r: int, n: int) -> torch.Tensor:  # (all of them: the piece as it is)
            part = self.piece if n == self.piece.shape[0] else narrow_piece(self.piece, 0, r, n)
            return dequantize_piece(part).to(x.dtype)

        return sliced_linear(x, self.piece.shape, 4, weight_rows)


def sliced_linear(x: torch.Tensor, shape: tuple[int, int], value_bytes: int,
                  weight_rows: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x @ W^T for a [rows, cols] weight made a slice of rows at a time (`weight_rows(r, n)`: rows
    r .. r + n in x's dtype, `value_bytes` a value while they are made): at most
    REFERENCE_SLICE_BYTES of float weight live at once."""
    rows, cols = shape
    step = max(1, REFERENCE_SLICE_BYTES // max(1, cols * value_bytes))
    if step >= rows:
        return F.linear(x, weight_rows(0, rows))
    out = torch.empty(x.shape[0], rows, dtype=x.dtype, device=x.device)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        out[:, r:r + n] = F.linear(x, weight_rows(r, n))
    return out


def kernel_for(kind: str, shape: tuple[int, int], device_type: str,
               kernels: list[type[QuantKernel]]) -> tuple[type[QuantKernel] | None, str]:
    """The first kernel class that runs a `kind` weight of `shape` here (None: the reference), and
    why the others did not."""
    reasons = []
    for cls in kernels:
        if device_type not in cls.device_types or kind not in cls.kinds:
            continue
        why = cls.unavailable(kind, shape)
        if why is None:
            return cls, ""
        reasons.append(f"{cls.name}: {why}")
    return None, "; ".join(reasons) or f"no {device_type} kernel runs {kind}"


class KernelRefused(Exception):
    """Raised by a QuantKernel made for a piece whose tensors it cannot run as they are (its
    scales' dtype, say); the piece then runs on the reference, with this reason."""


def choose_kernel(piece: QuantPiece, device_type: str, kernels: list[type[QuantKernel]]) -> tuple[QuantKernel, str]:
    """The kernel for `piece` (made: it may repack), else the reference; and why not another."""
    cls, why = kernel_for(piece.kind, piece.shape, device_type, kernels)
    if cls is not None:
        try:
            return cls(piece), ""
        except KernelRefused as e:
            why = f"{cls.name}: {e}"
    return ReferenceKernel(piece), why


class QuantLinearMethod(LinearMethod):
    """A quantised layer's product: each segment through its kernel (chosen when the weights are
    processed after loading), the rows concatenated."""

    def __init__(self, device_type: str, kernels: list[type[QuantKernel]]):
        self.device_type = device_type
        self.kernels = kernels

    def process_weights_after_loading(self, layer) -> None:
        layer.quant_kernels = []
        layer.quant_choices = []
        for s in layer.qweight.segments:
            kernel, why = choose_kernel(s.piece, self.device_type, self.kernels)
            layer.quant_kernels.append((s.row0, kernel))
            layer.quant_choices.append((s.piece.kind, kernel.name, why))
            if kernel.piece is not s.piece:  # it repacked: the layout it runs is the one held
                s.piece = kernel.piece
            s.kernel = kernel

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kernels = layer.quant_kernels
        if x.numel() == 0:  # no rows (the LM head of a prefill chunk that samples nothing): no
            # kernel is asked to multiply nothing (the CPU kernels refuse it: a lone prompt longer
            # than a step's token budget failed every GGUF model there)
            out = x.new_empty(*x.shape[:-1], layer.qweight.shape[0])
        elif len(kernels) == 1 and kernels[0][1].piece.shape[0] == layer.qweight.shape[0]:
            out = kernels[0][1].apply(x)
        else:  # (zeros: an embedding's padding rows have no segment)
            out = torch.zeros(*x.shape[:-1], layer.qweight.shape[0], dtype=x.dtype, device=x.device)
            for row0, kernel in kernels:
                out[..., row0:row0 + kernel.piece.shape[0]] = kernel.apply(x)
        return out if bias is None else out + bias
