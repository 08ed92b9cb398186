"""The CPU plugin's quantised products (omni_qlinear) at every ISA level this CPU runs, against
the core's reference (dequantise as gguf.quants does, then multiply), and in the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from omniinfer.quantization import gguf_blocks, int8  # noqa: E402
from omniinfer.quantization.base import QuantPiece, dequantize_piece  # noqa: E402
from omniinfer.testing import kquant  # noqa: E402
from omniinfer_cpu.quant import CpuQuantKernel  # noqa: E402

KINDS = ["gguf:Q8_0", "gguf:Q4_0", "gguf:Q4_K", "gguf:Q6_K", "int8"]


def piece_of(kind: str, weight: torch.Tensor) -> QuantPiece:
    if kind == "int8":
        return int8.quantize(weight)
    name = kind.split(":")[1]
    w = weight.numpy()
    data = kquant.QUANTIZERS[name](w) if name in kquant.QUANTIZERS else \
        gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])
    raw = torch.from_numpy(np.ascontiguousarray(data.view(np.uint8).reshape(weight.shape[0], -1)))
    assert raw.shape[1] == gguf_blocks.BY_NAME[name].row_bytes(weight.shape[1])
    return QuantPiece(kind, tuple(weight.shape), {"blocks": raw})


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qlinear_matches_the_reference(isa_level, kind, dtype):
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    for rows, cols in ((37, 512), (5, 256)):
        weight = torch.randn(rows, cols, generator=gen) * 0.05
        piece = piece_of(kind, weight)
        assert CpuQuantKernel.unavailable(kind, piece.shape) is None
        kernel = CpuQuantKernel(piece)
        assert kernel.name == f"cpu ({isa_level.level.name})"
        w = dequantize_piece(piece)
        for m in (1, 2, 3, 5, 8, 9, 70, 130):
            x = torch.randn(m, cols + 8, generator=gen)[:, 4:4 + cols].to(dtype)  # strided rows
            got = kernel.apply(x)
            want = F.linear(x.float(), w)
            assert got.dtype == dtype and got.shape == (m, rows)
            tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(got.float(), want if dtype == torch.float32 else want.to(dtype).float(),
                                       **tol)


def test_what_the_kernel_leaves_to_the_reference(isa_level):
    assert CpuQuantKernel.unavailable("gguf:Q4_K", (8, 128)) == "128 columns are not whole blocks"
    assert "gguf:Q5_K" not in CpuQuantKernel.kinds  # (the reference runs it)
