"""The CPU plugin's products for quantised weights (quant.c's `omni_qlinear`): GGUF's Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K blocks, and omniinfer's int8; at every ISA level; GGUF's
IQ4_NL, IQ4_XS, Q2_K and Q3_K with int8 activations. For float activations those are rewritten at
load as types that have a product (quantization/gguf_transcode.py: more bytes): Q3_K exactly as
Q6_K, IQ4_NL exactly as Q8_0, IQ4_XS and Q2_K as Q8_0 within the bounds it states. llama.cpp's
lattice types (IQ1_S/M, IQ2_XXS/XS/S, IQ3_XXS/S) have no product of their own: rewritten so
always (IQ3 and IQ1 as Q6_K, IQ2 as Q8_0: 2-5x their bytes; the kernel's name says "as Q6_K").
(F16, BF16 and F32 tensors load as float weights.) FP8 checkpoints' e4m3 rows run as they are,
decoded exactly in registers, with float activations (a scale per 128 columns).

Activations: by default each row of x is rounded to int8 in blocks of 32 and meets the weight
blocks in integer multiply-adds (quant_q8.c, as llama.cpp's q8 dot products; the GGUF kinds'
rows repacked in groups of 8 first, quant_x8.py); with ``OMNIINFER_CPU_QUANT_ACTIVATIONS=float``
x stays float32 and the product differs from dequantise-then-multiply by float32 rounding only
(quant.c). docs/quantization.md states both.

Symmetric GPTQ / AWQ / compressed-tensors weights (wint4, wint8 without zero points or act-order)
are the same numbers as Q4_0 / Q8_0 blocks when their scales are float16 values: `(code - 8) *
scale` is Q4_0's `(q - 8) * d`, `(code - 128) * scale` Q8_0's `q * d`, a group of 32..128 inputs
one to four blocks sharing a scale; they are repacked so, once, losslessly (a scale float16 cannot
hold keeps the reference). compressed-tensors W8A8 runs as omniinfer's int8: its activations
rounded in blocks of 32 as every int8-activation product here (finer than the checkpoint's one
scale a token), or float with the switch above."""

from __future__ import annotations

import functools

import torch

from omniinfer.quantization.base import QuantKernel
from omniinfer.quantization.fp8 import KINDS as FP8_KINDS
from omniinfer.quantization.fp8 import block_of
from omniinfer.quantization.gguf_blocks import BY_NAME
from omniinfer.quantization.gguf_transcode import LATTICE_AS, REWRITES
from omniinfer.quantization.int_pieces import WINT_KINDS

KIND_CODES = {"gguf:Q8_0": 0, "gguf:Q4_0": 1, "gguf:Q4_K": 2, "gguf:Q6_K": 3, "int8": 4, "gguf:Q4_1": 9,
              "gguf:Q5_0": 10, "gguf:Q5_1": 11, "gguf:Q5_K": 12}  # (quant_blocks.h's)
BLOCK = {kind: BY_NAME[kind[5:]].block if kind.startswith("gguf:") else 1 for kind in KIND_CODES}
# symmetric n-bit weights of any group size the blocks divide, repacked as Q4_0 / Q8_0
WINT = {k: 1 if k.startswith("wint4") else 0 for k in WINT_KINDS if k.count(":") == 1}  # symmetric, no g_idx
KIND_CODES.update({**WINT, "w8a8": 4, "w8a8:static": 4})
BLOCK.update({**dict.fromkeys(WINT, 32), "w8a8": 1, "w8a8:static": 1})
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
ACT_ENV = "OMNIINFER_CPU_QUANT_ACTIVATIONS"
ACT_MODES = ("int8", "float")
QACT_INT8 = 64  # quant_blocks.h: set in a kind code, x is rounded to int8 blocks
# quant_blocks.h: rows in groups of 8 (int8 activations only), by the kind they come from
X8_CODES = {"gguf:Q4_0": 5, "gguf:Q8_0": 6, "gguf:Q4_K": 7, "gguf:Q6_K": 8, "gguf:Q4_1": 13, "gguf:Q5_0": 14,
            "gguf:Q5_1": 15, "gguf:Q5_K": 16, "gguf:IQ4_NL": 17, "gguf:IQ4_XS": 18, "gguf:Q2_K": 19,
            "gguf:Q3_K": 20}
# the kinds with no row-at-a-time code: their groups of 8 run int8 activations (csrc/quant_iq4x8.c,
# quant_k23x8.c); with float activations they take their rewrite (TRANSCODED)
X8_ONLY = ("gguf:IQ4_NL", "gguf:IQ4_XS", "gguf:Q2_K", "gguf:Q3_K")
GGUF_OF_CODE = {code: kind for kind, code in KIND_CODES.items() if kind.startswith("gguf:")}
# GGUF types with no float-activation kernel of their own, rewritten at load as one that has
# (quantization/gguf_transcode.py): exactly, Q3_K as Q6_K and IQ4_NL as Q8_0; within float16's
# rounding of a scale, IQ4_XS as Q8_0; requantised to 8 bits, Q2_K as Q8_0
TRANSCODED = {f"gguf:{k}": f"gguf:{v}" for k, v in REWRITES.items()}
# FP8 checkpoints' e4m3 rows (quant_blocks.h's F8: a float32 scale a 128 columns; a coarser scale is
# spread over them); float activations only
F8_CODE, F8_BLOCK = 21, 128
# bfloat16 x of more rows than this (quant.c's QGEMM_ROWS: where its float32 panels take over),
# where oneDNN multiplies bfloat16 in hardware (bf16_matmul): the FP8 weight is decoded to
# bfloat16 in slices of rows (omni_qrows) and multiplied by torch's bfloat16 matmul, the
# reference's arithmetic; 2x faster than the panels from 16 rows (9728 x 896: 2.7 against 4.9 ms
# at 16 rows, 8.2 against 14.3 at 128; Zen 4, avx512_bf16). Without bfloat16 hardware (AVX2)
# torch's bfloat16 matmul is far slower than the panels (a 128-token prefill of the medium model
# took 2.5 s, the panels 0.6), and with float32 x the panels are as fast or faster: they stay.
F8_PANEL_ROWS = 8


@functools.lru_cache(maxsize=1)
def bf16_matmul() -> bool:
    """Whether torch's bfloat16 matmul runs on bfloat16 hardware here (oneDNN says so)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def fp8_prefill_rows(dtype: torch.dtype) -> int:
    """The most rows of `dtype` x an FP8 product takes through omni_qlinear (more: torch's matmul
    on the weight decoded to bfloat16)."""
    return F8_PANEL_ROWS if dtype == torch.bfloat16 and bf16_matmul() else 1 << 30


def activation_mode() -> str:
    """How the quantised products take their activations: "int8" (the default) or "float"."""
    import os

    mode = os.environ.get(ACT_ENV, "int8").strip().lower() or "int8"
    if mode not in ACT_MODES:
        raise ValueError(f"{ACT_ENV}={os.environ[ACT_ENV]!r} is not one of {', '.join(ACT_MODES)}")
    return mode


class CpuQuantKernel(QuantKernel):
    name = "cpu"
    device_types = ("cpu",)
    kinds = (*KIND_CODES, *(k for k in WINT_KINDS if k not in WINT), *TRANSCODED, *FP8_KINDS)

    @classmethod
    def unavailable(cls, kind: str, shape: tuple[int, int]) -> str | None:
        from omniinfer_cpu.kernels import build

        kind = TRANSCODED.get(kind, kind)
        if kind in FP8_KINDS:
            if shape[1] % F8_BLOCK:
                return f"{shape[1]} columns are not whole blocks of {F8_BLOCK}"
            if block_of(kind, shape[1]) % F8_BLOCK:
                return f"its scales cover {block_of(kind, shape[1])} columns each, not a multiple of {F8_BLOCK}"
            kernels = build.load()
            if kernels is None:
                return f"the CPU kernels are unavailable: {build.unavailable_reason()}"
            return None if kernels.quant_supported(F8_CODE) else "omni_qlinear has no fp8 here"
        if kind.startswith("wint") and kind not in WINT:
            return ("asymmetric (zero points) or act-order (g_idx) weights: omni_qlinear runs symmetric "
                    "int4/int8 in contiguous groups only")
        if kind not in KIND_CODES:
            return f"omni_qlinear has no {kind}"
        kernels = build.load()
        if kernels is None:
            return f"the CPU kernels are unavailable: {build.unavailable_reason()}"
        if not kernels.quant_supported(KIND_CODES[kind]):
            return f"omni_qlinear has no {kind} here"
        if shape[1] % (max(BLOCK[kind], 16) if BLOCK[kind] > 1 else 1):
            return f"{shape[1]} columns are not whole blocks"
        return None

    def __init__(self, piece):
        from omniinfer_cpu.kernels import build

        if piece.kind in FP8_KINDS:
            super().__init__(piece)
            self.k, self.activations, self.code = build.load(), "float", F8_CODE
            cols = piece.shape[1]
            self.w = piece.tensors["q"]
            self.scale = spread_scales(piece.tensors["scale"], block_of(piece.kind, cols), cols)
            self.name = f"cpu ({self.k.level.name}, float activations)"
            return
        activations = activation_mode() if piece.shape[1] % 32 == 0 else "float"
        original_kind = piece.kind
        native = piece.kind in X8_ONLY and activations == "int8"
        if piece.kind in TRANSCODED and not native:  # the same numbers as a type omni_qlinear runs (held instead)
            from omniinfer.quantization.base import KernelRefused, QuantPiece
            from omniinfer.quantization.gguf_transcode import transcode

            try:
                target, blocks = transcode(piece.kind[5:], piece.tensors["blocks"], piece.shape[1])
            except ValueError as e:
                raise KernelRefused(str(e)) from None
            piece = QuantPiece(f"gguf:{target}", piece.shape, {"blocks": blocks})
        super().__init__(piece)
        self.k = build.load()
        self.activations = activations
        tensors = piece.tensors
        if native:  # (repacked in groups of 8 below: their only kernel)
            self.code, self.w, self.scale = X8_CODES[piece.kind], tensors["blocks"], None
        elif piece.kind in WINT:
            self.code, self.w, self.scale = KIND_CODES[piece.kind], as_blocks(piece), None
        else:
            self.code = KIND_CODES[piece.kind]
            self.w = tensors["q"] if piece.kind.split(":")[0] in ("int8", "w8a8") else tensors["blocks"]
            self.scale = tensors.get("scale")
        if self.activations == "int8":
            original = piece.kind if native else GGUF_OF_CODE.get(self.code)
            self.code |= QACT_INT8
            if original:  # GGUF rows (symmetric wint8 / wint4 as Q8_0 / Q4_0 too) in groups of 8 (quant_x8.py)
                from omniinfer_cpu import quant_x8

                self.piece = quant_x8.repack(original, self.w, piece.shape)  # (replaces the layer's piece)
                self.w, self.code = self.piece.tensors["blocks8"], X8_CODES[original] | QACT_INT8
        rewrite = f", as {LATTICE_AS[original_kind[5:]]}" if original_kind[5:] in LATTICE_AS else ""
        amx = " + AMX tiles for prefills" if self.k.amx == "on" and self.activations == "int8" and (
            "blocks8" in self.piece.tensors or self.code == KIND_CODES["int8"] | QACT_INT8) else ""
        self.name = f"cpu ({self.k.level.name}{amx}, {self.activations} activations{rewrite})"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = self.piece.shape
        if x.dtype not in DTYPE_CODES or x.dim() != 2:
            from omniinfer.quantization.base import ReferenceKernel

            return ReferenceKernel(self.piece).apply(x)
        if self.code == F8_CODE and x.shape[0] > fp8_prefill_rows(x.dtype):
            return self._dequantized_matmul(x)
        if x.stride(1) != 1:
            x = x.contiguous()
        out = torch.empty(x.shape[0], rows, dtype=x.dtype)
        rc = self.k.qlinear(x.data_ptr(), x.stride(0), self.w.data_ptr(),
                            None if self.scale is None else self.scale.data_ptr(), out.data_ptr(),
                            out.stride(0), x.shape[0], rows, cols, self.code, DTYPE_CODES[x.dtype],
                            torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"omni_qlinear failed ({rc}) for a {self.piece.kind} weight of shape {self.piece.shape}")
        return out

    def _dequantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T with W decoded to x's dtype (omni_qrows) a slice of rows at a time."""
        from omniinfer.quantization.base import sliced_linear

        return sliced_linear(x, self.piece.shape, x.element_size(),
                             lambda r, n: self.rows(torch.arange(r, r + n), x.dtype))

    @classmethod
    def experts_step(cls, w13: list, w2: list):
        from omniinfer_cpu.moe import CpuExpertsStep

        return CpuExpertsStep.of(w13, w2)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Rows `ids` decoded in C (quant_rows.c: the reference's values, bit for bit)."""
        if dtype not in DTYPE_CODES or ids.device.type != "cpu":
            return None
        num_rows, cols = self.piece.shape
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), cols, dtype=dtype)
        rc = self.k.qrows(self.w.data_ptr(), None if self.scale is None else self.scale.data_ptr(), self.code,
                          num_rows, cols, ids.data_ptr(), ids.numel(), out.data_ptr(), DTYPE_CODES[dtype],
                          torch.get_num_threads())
        if rc == -2:
            bad = ids[(ids < 0) | (ids >= num_rows)][0].item()
            raise IndexError(f"row {bad} of a {self.piece.kind} table of {num_rows} rows: ids must be in [0, {num_rows})")
        if rc != 0:
            raise RuntimeError(f"omni_qrows failed ({rc}) for a {self.piece.kind} weight of shape {self.piece.shape}")
        return out


def spread_scales(scale: torch.Tensor, block: int, cols: int) -> torch.Tensor:
    """An fp8 piece's scales (a `block` of columns each) as F8's: float32 [rows, cols / 128]."""
    per = cols // F8_BLOCK
    if block == F8_BLOCK:
        return scale.float().contiguous()
    return scale.float().repeat_interleave(block // F8_BLOCK, dim=1)[:, :per].contiguous()


def as_blocks(piece) -> torch.Tensor:
    """A symmetric wint4 / wint8 piece as Q4_0 / Q8_0 blocks, uint8 [rows, blocks * bytes]."""
    from omniinfer.quantization.base import KernelRefused
    from omniinfer.quantization.int_packing import unpack_int32
    from omniinfer.quantization.int_pieces import parse_wint

    bits, group, _, _ = parse_wint(piece.kind)
    rows, cols = piece.shape
    scales = piece.tensors["scales"]  # [groups, rows]
    half = scales.to(torch.float16)
    if not bool(torch.equal(half.to(scales.dtype), scales)) or not bool(torch.isfinite(half).all()):
        raise KernelRefused(f"its {scales.dtype} scales are not all float16 values (Q4_0 / Q8_0 blocks "
                            "hold float16 scales)")
    nb = cols // 32
    group = group or cols
    d = half.t()[:, torch.arange(nb) * 32 // group].contiguous()  # [rows, blocks]
    codes = unpack_int32(piece.tensors["qweight"], bits, 0, cols).t().reshape(rows, nb, 32)
    if bits == 4:  # Q4_0: byte j holds weight j (low nibble) and weight j + 16 (high)
        qs = (codes[..., :16] | (codes[..., 16:] << 4)).to(torch.uint8)
    else:  # Q8_0: signed bytes
        qs = (codes - 128).to(torch.int8).view(torch.uint8)
    blocks = torch.cat([d.unsqueeze(-1).view(torch.uint8), qs], dim=-1)
    return blocks.reshape(rows, -1).contiguous()
