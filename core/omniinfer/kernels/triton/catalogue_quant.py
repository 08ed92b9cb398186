"""The kernel catalogue's quantized linear layers (catalogue.py's SOURCES lists them): the n-bit
and int8 products (quant_gemm.py, int8_gemm.py), GGUF blocks (gguf_gemm.py) and FP8 weights
(fp8_gemm.py), each a set of shapes and the launch code they run on ``meta`` tensors.

Importing this module imports torch, not triton (nor catalogue.py: its KernelLaunch is imported
where a launch is made, so that catalogue.py can import these at its top).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch

from omniinfer.quantization.gguf_blocks import QUANTIZED
from omniinfer.quantization.gguf_iq import LATTICE

if TYPE_CHECKING:
    from omniinfer.kernels.triton.catalogue import KernelLaunch


# ---- quantized linear layers (kernels/triton/quant_gemm.py, int8_gemm.py) ----------------------
@dataclass(frozen=True, slots=True)
class QuantShape:
    """One quantized linear layer as the launchers see it (a refusal's predicate reads it)."""

    model: str  # where the numbers come from
    dtype: torch.dtype  # activations
    m: int  # rows (tokens) of the product
    n: int  # outputs on one rank
    k: int  # inputs
    bits: int = 4
    group_size: int = 128  # -1: one group
    has_zeros: bool = False  # asymmetric (AWQ, GPTQ sym=False)
    has_g_idx: bool = False  # act-order
    has_bias: bool = False
    mode: str = "weight-only"  # int8_matmul: "w8a8 dynamic", "w8a8 static", "w8a16"

    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.").replace("bfloat", "bf").replace("float", "fp")
        if self.mode != "weight-only":
            return f"{dtype} {self.mode} m{self.m} {self.n}x{self.k} ({self.model})"
        group = "channel" if self.group_size == -1 else f"g{self.group_size}"
        extras = "".join((" zeros" if self.has_zeros else "", " g_idx" if self.has_g_idx else "",
                          " bias" if self.has_bias else ""))
        return f"{dtype} int{self.bits} {group}{extras} m{self.m} {self.n}x{self.k} ({self.model})"


# Per-rank projections of Llama-3-8B (qkv 6144x4096, gate_up 28672x4096, down 4096x14336) and
# Qwen2-7B (qkv with bias) at a 512-token prefill chunk and at decode batches: each shape stresses
# one thing the others do not (the common GPTQ case; AWQ's zero points; act-order's gathered
# scales at the smallest group; 8 bits; float32's FMA dots; decode tiles of 1, 4 and 8 rows).
# The tiles are the launchers' own (wn_tiles, int8_tiles): only shapes pick among them.
_QUANT: tuple[QuantShape, ...] = (
    QuantShape("llama-3-8b gate_up", torch.bfloat16, 512, 28672, 4096),
    QuantShape("llama-3-8b qkv awq", torch.float16, 512, 6144, 4096, has_zeros=True),
    QuantShape("llama-3-8b down desc_act", torch.float16, 512, 4096, 14336, group_size=32,
               has_g_idx=True),
    QuantShape("qwen2-7b qkv", torch.bfloat16, 16, 4608, 3584, bits=8, has_zeros=True,
               has_bias=True),
    QuantShape("llama-3-8b qkv", torch.float32, 512, 6144, 4096, group_size=-1),
    QuantShape("llama-3-8b gate_up", torch.bfloat16, 1, 28672, 4096),
    QuantShape("llama-3-8b qkv awq", torch.float16, 8, 6144, 4096, has_zeros=True),
    QuantShape("llama-3-8b down desc_act", torch.float16, 1, 4096, 14336, group_size=32,
               has_g_idx=True),
    QuantShape("llama-3-8b down", torch.bfloat16, 4, 4096, 14336, bits=8, has_zeros=True),
    QuantShape("llama-3-8b qkv", torch.float32, 1, 6144, 4096, group_size=-1),
    QuantShape("llama-3-8b gate_up", torch.bfloat16, 512, 28672, 4096, bits=8,
               mode="w8a8 dynamic"),
    QuantShape("llama-3-8b qkv", torch.float16, 1, 6144, 4096, bits=8, mode="w8a8 static"),
    QuantShape("llama-3-8b down", torch.bfloat16, 1, 4096, 14336, bits=8, mode="w8a8 dynamic"),
    QuantShape("llama-3-8b down", torch.bfloat16, 512, 4096, 14336, bits=8, mode="w8a16"),
    QuantShape("llama-3-8b qkv", torch.float32, 1, 6144, 4096, bits=8, mode="w8a16"),
    QuantShape("llama-3-8b gate_up", torch.bfloat16, 1, 28672, 4096, bits=8, mode="w8a16"),
)


def _quant_launch(shape: QuantShape) -> None:
    from omniinfer.kernels.triton.dequant_linear import int8_linear, wn_linear

    meta = dict(device="meta")
    x = torch.empty(shape.m, shape.k, dtype=shape.dtype, **meta)
    bias = torch.empty(shape.n, dtype=shape.dtype, **meta) if shape.has_bias else None
    if shape.mode != "weight-only":
        static = torch.empty(1, **meta) if shape.mode == "w8a8 static" else None
        int8_linear(x, torch.empty(shape.n, shape.k, dtype=torch.int8, **meta),
                    torch.empty(shape.n, **meta), static, shape.mode != "w8a16", bias)
        return
    groups = 1 if shape.group_size == -1 else -(-shape.k // shape.group_size)
    scale_dtype = torch.float16 if shape.dtype == torch.float32 else shape.dtype
    scales = torch.empty(groups, shape.n, dtype=scale_dtype, **meta)
    wn_linear(x, torch.empty(-(-shape.k // (32 // shape.bits)), shape.n, dtype=torch.int32, **meta),
              scales, torch.empty_like(scales) if shape.has_zeros else None,
              torch.empty(shape.k, dtype=torch.int32, **meta) if shape.has_g_idx else None,
              shape.bits, shape.k if shape.group_size == -1 else shape.group_size, bias)


def quant_launches() -> list[KernelLaunch]:
    """What the quantized linear layers launch: through `wn_linear`, the split-K GEMV (wn_gemv)
    for a few rows and `wn_dequantize` (then torch's matmul) for more; through `int8_linear`,
    `int8_matmul` (with its activation quantization for W8A8; W8A16 up to INT8_FUSED_MAX_M rows)
    or `int8_dequantize`. (wn_matmul's tl.dot GEMM, which no layer launches, is timed by
    benchmarks/quant_kernels.py --path fused.)"""
    from omniinfer.kernels.triton.catalogue import KernelLaunch
    from omniinfer.kernels.triton.dequant_linear import INT8_FUSED_MAX_M, wn_fused_max_m

    launches = []
    for shape in _QUANT:
        op = (("int8_dequantize" if shape.mode == "w8a16" and shape.m > INT8_FUSED_MAX_M else "int8_matmul")
              if shape.mode != "weight-only"
              else "wn_gemv" if shape.m <= wn_fused_max_m(shape.has_g_idx) else "wn_dequantize")
        launches.append(KernelLaunch(op, shape.label(), shape, partial(_quant_launch, shape)))
    return launches


# ---- GGUF blocks (kernels/triton/gguf_gemm.py) --------------------------------------------------
@dataclass(frozen=True, slots=True)
class GGUFShape:
    """One GGUF-quantised linear layer as `gguf_matmul` sees it."""

    model: str
    dtype: torch.dtype  # activations
    m: int
    n: int
    k: int
    type_name: str  # "Q4_K": the block type (a constexpr: each compiles its own decoder)

    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.").replace("bfloat", "bf").replace("float", "fp")
        return f"{dtype} {self.type_name} m{self.m} {self.n}x{self.k} ({self.model})"


# Every block type at decode (the GEMV) and at a 512-token prefill chunk (dequantised), on
# Llama-3-8B's gate_up and down (Q4_K_M files hold Q4_K, Q6_K, Q8_0; the classic types are older
# files' and narrow models' fallbacks; the lattice types run as their rewrites, gguf_transcode.py).
_GGUF: tuple[GGUFShape, ...] = tuple(
    GGUFShape(f"llama-3-8b {layer}", dtype, m, n, k, t)
    for t in QUANTIZED if t not in LATTICE
    for m, layer, n, k, dtype in ((1, "gate_up", 28672, 4096, torch.bfloat16),
                                  (512, "down", 4096, 14336, torch.float16))) + (
    GGUFShape("llama-3-8b down", torch.float32, 512, 4096, 14336, "Q5_K"),)  # (float32's FMA tiles)


def _gguf_launch(shape: GGUFShape) -> None:
    from omniinfer.kernels.triton.dequant_linear import gguf_linear
    from omniinfer.quantization.gguf_blocks import BY_NAME

    meta = dict(device="meta")
    blocks = torch.empty(shape.n, BY_NAME[shape.type_name].row_bytes(shape.k), dtype=torch.uint8,
                         **meta)
    gguf_linear(torch.empty(shape.m, shape.k, dtype=shape.dtype, **meta), blocks, shape.type_name)


def gguf_launches() -> list[KernelLaunch]:
    """What GGUF layers launch on a GPU through `gguf_linear`, per block type: the split-K GEMV
    (gguf_gemv) for a few rows, `gguf_dequantize` (then torch's matmul) for more. (gguf_matmul's
    tl.dot GEMM, which no layer launches, is timed by benchmarks/gguf_tiles.py.)"""
    from omniinfer.kernels.triton.catalogue import KernelLaunch
    from omniinfer.kernels.triton.dequant_linear import gguf_fused_max_m

    return [KernelLaunch("gguf_gemv" if shape.m <= gguf_fused_max_m(shape.type_name) else "gguf_dequantize",
                         shape.label(), shape, partial(_gguf_launch, shape)) for shape in _GGUF]


# ---- FP8 weights (kernels/triton/fp8_gemm.py) ---------------------------------------------------
@dataclass(frozen=True, slots=True)
class FP8Shape:
    """One FP8 linear layer as `fp8_linear` sees it: e4m3 codes [n, k], a float32 scale a row and
    block of `scale_cols` inputs (k: one a row)."""

    model: str
    dtype: torch.dtype  # activations
    m: int
    n: int
    k: int
    scale_cols: int = 128

    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.").replace("bfloat", "bf").replace("float", "fp")
        scales = "a row" if self.scale_cols >= self.k else f"b{self.scale_cols}"
        return f"{dtype} fp8 {scales} m{self.m} {self.n}x{self.k} ({self.model})"


# Qwen3-8B-FP8's per-rank projections (blocks of 128 x 128; gate_up 24576 x 4096, down 4096 x
# 12288) at decode (the GEMV, 1 and 4 rows) and at a 512-token prefill chunk (dequantised), and a
# compressed-tensors FP8 file's per-channel scales in float32 (a scale a row).
_FP8: tuple[FP8Shape, ...] = (
    FP8Shape("qwen3-8b gate_up", torch.bfloat16, 1, 24576, 4096),
    FP8Shape("qwen3-8b down", torch.float16, 4, 4096, 12288),
    FP8Shape("qwen3-8b down", torch.bfloat16, 512, 4096, 12288),
    FP8Shape("llama-3-8b qkv", torch.float32, 1, 6144, 4096, scale_cols=4096),
    FP8Shape("llama-3-8b qkv", torch.float32, 512, 6144, 4096, scale_cols=4096),
)


def _fp8_launch(shape: FP8Shape) -> None:
    from omniinfer.kernels.triton.dequant_linear import fp8_linear

    meta = dict(device="meta")
    fp8_linear(torch.empty(shape.m, shape.k, dtype=shape.dtype, **meta),
               torch.empty(shape.n, shape.k, dtype=torch.uint8, **meta),
               torch.empty(shape.n, -(-shape.k // shape.scale_cols), **meta), shape.scale_cols)


def fp8_launches() -> list[KernelLaunch]:
    """What FP8 layers launch on a GPU through `fp8_linear`: the split-K GEMV (fp8_gemv) for a
    few rows, `fp8_dequantize` (then torch's matmul) for more."""
    from omniinfer.kernels.triton.catalogue import KernelLaunch
    from omniinfer.kernels.triton.dequant_linear import FP8_FUSED_MAX_M

    return [KernelLaunch("fp8_gemv" if shape.m <= FP8_FUSED_MAX_M else "fp8_dequantize",
                         shape.label(), shape, partial(_fp8_launch, shape)) for shape in _FP8]
