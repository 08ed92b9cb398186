"""The portable Triton products (kernels/triton/quant_gemm.py, gguf_gemm.py, int8_gemm.py,
fp8_gemm.py; for more than a few rows, the weight-only weights dequantised then torch's matmul:
dequant_linear.py) as a QuantKernel, for the GPU plugins to declare (CUDA, ROCm and XPU all run
Triton): GPTQ / AWQ / compressed-tensors n-bit weights (every wint kind), compressed-tensors W8A8
(activations quantised to int8 per token, or with the checkpoint's static scale), omniinfer's
int8 (W8A16), FP8 checkpoints' e4m3 weights (weight-only: activations stay float) and every GGUF
block type the loader takes, read as the file stores it (no repacking: the layer holds the
file's bytes). Importing this module imports no Triton."""

from __future__ import annotations

import importlib.util

import torch

from omniinfer.quantization.base import QuantKernel
from omniinfer.quantization.fp8 import KINDS as FP8_KINDS
from omniinfer.quantization.fp8 import block_of
from omniinfer.quantization.gguf_blocks import QUANTIZED
from omniinfer.quantization.gguf_transcode import LATTICE_AS
from omniinfer.quantization.int_pieces import WINT_KINDS

# every GGUF block type the loader takes: kernels/triton/gguf_gemm.py decodes each (its
# KERNEL_TYPES) but the lattice types, rewritten at load as the type LATTICE_AS names
GGUF_KINDS = tuple(f"gguf:{t}" for t in QUANTIZED)


class TritonQuantKernel(QuantKernel):
    name = "triton"
    device_types = ("cuda", "xpu")  # (ROCm's torch device type is "cuda")
    kinds = (*WINT_KINDS, "w8a8", "w8a8:static", "int8", *GGUF_KINDS, *FP8_KINDS)

    @classmethod
    def unavailable(cls, kind: str, shape: tuple[int, int]) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        return None

    def __init__(self, piece):
        super().__init__(piece)
        # the kernel module and the weight's tensors resolved once here, not on every product
        family, _, gguf_type = piece.kind.partition(":")
        if family == "gguf" and gguf_type in LATTICE_AS:  # (the same numbers, or half a Q8_0 step near)
            from omniinfer.quantization.base import KernelRefused, QuantPiece
            from omniinfer.quantization.gguf_transcode import transcode

            try:
                gguf_type, blocks = transcode(gguf_type, piece.tensors["blocks"], piece.shape[1])
            except ValueError as e:
                raise KernelRefused(str(e)) from None
            piece = self.piece = QuantPiece(f"gguf:{gguf_type}", piece.shape, {"blocks": blocks})
        if family == "gguf":
            from omniinfer.kernels.triton.dequant_linear import gguf_linear

            w = self.weight = piece.tensors["blocks"]  # the file's bytes, as the layer holds them
            self._product = lambda x: gguf_linear(x, w, gguf_type)
        elif family == "fp8":
            from omniinfer.kernels.triton.dequant_linear import fp8_linear

            q, scale = self.weight = piece.tensors["q"], piece.tensors["scale"]
            cols = block_of(piece.kind, piece.shape[1])
            self._product = lambda x: fp8_linear(x, q, scale, cols)
        elif family.startswith("wint"):
            from omniinfer.kernels.triton.dequant_linear import wn_linear
            from omniinfer.quantization.int_pieces import packed_weight

            w = self.weight = packed_weight(piece)
            self._product = lambda x: wn_linear(x, w.qweight, w.scales, w.zeros, w.g_idx, w.bits,
                                                w.group_size)
        else:
            from omniinfer.kernels.triton.dequant_linear import int8_linear
            from omniinfer.quantization.int_pieces import int8_weight

            w = self.weight = int8_weight(piece)
            w8a8 = family == "w8a8"
            self._product = lambda x: int8_linear(x, w.weight, w.weight_scale, w.input_scale,
                                                  quantize_activations=w8a8)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x)
