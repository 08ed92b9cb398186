"""The CPU plugin's products for quantised weights (quant.c's `omni_qlinear`): GGUF's Q8_0, Q4_0,
Q4_K and Q6_K blocks, as the file stores them, and omniinfer's int8; decoded in registers at
every ISA level, multiplied in float32. Other GGUF types run the core's reference."""

from __future__ import annotations

import torch

from omniinfer.quantization.base import QuantKernel

KIND_CODES = {"gguf:Q8_0": 0, "gguf:Q4_0": 1, "gguf:Q4_K": 2, "gguf:Q6_K": 3, "int8": 4}
BLOCK = {"gguf:Q8_0": 32, "gguf:Q4_0": 32, "gguf:Q4_K": 256, "gguf:Q6_K": 256, "int8": 1}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


class CpuQuantKernel(QuantKernel):
    name = "cpu"
    device_types = ("cpu",)
    kinds = tuple(KIND_CODES)

    @classmethod
    def unavailable(cls, kind: str, shape: tuple[int, int]) -> str | None:
        from omniinfer_cpu.kernels import build

        kernels = build.load()
        if kernels is None:
            return f"the CPU kernels are unavailable: {build.unavailable_reason()}"
        if not kernels.quant_supported(KIND_CODES[kind]):
            return f"omni_qlinear has no {kind} here"
        if shape[1] % max(BLOCK[kind], 16 if kind != "int8" else 1):
            return f"{shape[1]} columns are not whole blocks"
        return None

    def __init__(self, piece):
        from omniinfer_cpu.kernels import build

        super().__init__(piece)
        self.k = build.load()
        self.code = KIND_CODES[piece.kind]
        tensors = piece.tensors
        self.w = tensors["q"] if piece.kind == "int8" else tensors["blocks"]
        self.scale = tensors.get("scale")
        self.name = f"cpu ({self.k.level.name})"

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        rows, cols = self.piece.shape
        if x.dtype not in DTYPE_CODES or x.dim() != 2:
            from omniinfer.quantization.base import ReferenceKernel

            return ReferenceKernel(self.piece).apply(x)
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
