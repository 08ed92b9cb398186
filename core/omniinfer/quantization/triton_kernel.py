"""The portable Triton products (kernels/triton/quant_gemm.py, gguf_gemm.py) as a QuantKernel,
for the GPU plugins to declare (CUDA, ROCm and XPU all run Triton): GPTQ / AWQ /
compressed-tensors n-bit weights (every wint kind), compressed-tensors W8A8 (activations
quantised to int8 per token, or with the checkpoint's static scale), omniinfer's int8 (W8A16)
and every GGUF block type the loader takes, read as the file stores it (no repacking: the layer
holds the file's bytes). Importing this module imports no Triton."""

from __future__ import annotations

import importlib.util

import torch

from omniinfer.quantization.base import QuantKernel
from omniinfer.quantization.gguf_blocks import QUANTIZED
from omniinfer.quantization.int_pieces import WINT_KINDS

# the GGUF block types kernels/triton/gguf_gemm.py decodes: every one (its KERNEL_TYPES)
GGUF_KINDS = tuple(f"gguf:{t}" for t in QUANTIZED)


class TritonQuantKernel(QuantKernel):
    name = "triton"
    device_types = ("cuda", "xpu")  # (ROCm's torch device type is "cuda")
    kinds = (*WINT_KINDS, "w8a8", "w8a8:static", "int8", *GGUF_KINDS)

    @classmethod
    def unavailable(cls, kind: str, shape: tuple[int, int]) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed"
        return None

    def __init__(self, piece):
        super().__init__(piece)
        family = piece.kind.split(":")[0]
        self.gguf_type = piece.kind.split(":")[1] if family == "gguf" else None
        if self.gguf_type is not None:
            self.weight = piece.tensors["blocks"]  # the file's bytes, as the layer holds them
        elif family.startswith("wint"):
            from omniinfer.quantization.int_pieces import packed_weight

            self.weight = packed_weight(piece)
        else:
            from omniinfer.quantization.int_pieces import int8_weight

            self.weight = int8_weight(piece)
        self.w8a8 = family == "w8a8"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        from omniinfer.kernels.triton import quant_gemm
        from omniinfer.quantization.int_layouts import PackedIntWeight

        w = self.weight
        if self.gguf_type is not None:
            from omniinfer.kernels.triton.gguf_gemm import gguf_matmul

            return gguf_matmul(x, w, self.gguf_type)
        if isinstance(w, PackedIntWeight):
            return quant_gemm.wn_matmul(x, w.qweight, w.scales, w.zeros, w.g_idx, w.bits, w.group_size)
        return quant_gemm.int8_matmul(x, w.weight, w.weight_scale, w.input_scale,
                                      quantize_activations=self.w8a8)
