"""GGUF blocks rewritten as another type (quantization/gguf_transcode.py) dequantise, by the
`gguf` package's own `gguf.quants.dequantize`, to the same float32 numbers bit for bit: random
blocks (every code, scale and high-bit pattern) and blocks of random weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from omniinfer.quantization import gguf_blocks, gguf_transcode  # noqa: E402
from omniinfer.testing.kquant import random_blocks  # noqa: E402


def dequantized(data: np.ndarray, name: str, rows: int, cols: int) -> np.ndarray:
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name]).reshape(rows, cols).astype(np.float32)


@pytest.mark.parametrize("name", sorted(gguf_transcode.EXACTLY_AS))
def test_rewritten_blocks_dequantise_to_the_same_numbers(name, monkeypatch):
    monkeypatch.setattr(gguf_transcode, "SLICE_BLOCKS", 5)  # several slices, a ragged last one
    kind = gguf_blocks.BY_NAME[name]
    rows, cols = 6, 3 * 256
    data = random_blocks(kind, rows, cols, np.random.default_rng(kind.code))
    target, out = gguf_transcode.transcode(name, torch.from_numpy(data), cols)
    assert target == gguf_transcode.EXACTLY_AS[name]
    assert out.shape == (rows, gguf_blocks.BY_NAME[target].row_bytes(cols)) and out.dtype == torch.uint8
    want = dequantized(data, name, rows, cols)
    got = dequantized(out.numpy(), target, rows, cols)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("name", sorted(gguf_transcode.EXACTLY_AS))
def test_quantised_weights_rewritten_are_the_same_numbers(name):
    from omniinfer.testing.kquant import QUANTIZERS

    weights = np.random.default_rng(1).standard_normal((5, 512)).astype(np.float32) * 0.05
    data = QUANTIZERS[name](weights)
    target, out = gguf_transcode.transcode(name, torch.from_numpy(data), 512)
    assert np.array_equal(dequantized(out.numpy(), target, 5, 512).view(np.int32),
                          dequantized(data, name, 5, 512).view(np.int32))


def _near(name: str, data: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    target, out = gguf_transcode.transcode(name, torch.from_numpy(data), cols)
    assert target == "Q8_0" and out.shape == (rows, gguf_blocks.BY_NAME["Q8_0"].row_bytes(cols))
    return dequantized(out.numpy(), target, rows, cols), dequantized(data, name, rows, cols)


@pytest.mark.parametrize("source", ["random", "weights"])
def test_iq4_xs_as_q8_0_moves_each_weight_by_at_most_2_to_the_minus_11(source, monkeypatch):
    monkeypatch.setattr(gguf_transcode, "SLICE_BLOCKS", 2)
    from omniinfer.testing.kquant import QUANTIZERS

    rows, cols = 6, 3 * 256
    rng = np.random.default_rng(2)
    data = (random_blocks(gguf_blocks.BY_NAME["IQ4_XS"], rows, cols, rng) if source == "random"
            else QUANTIZERS["IQ4_XS"](rng.standard_normal((rows, cols)).astype(np.float32) * 0.05))
    got, want = _near("IQ4_XS", data, rows, cols)
    scales = gguf_blocks.iq4_xs_scales(torch.from_numpy(data).reshape(-1, 136)).abs().reshape(rows, -1, 1)
    normal = np.broadcast_to((scales >= 2.0 ** -14).numpy(), (rows, cols // 32, 32)).reshape(rows, cols)
    assert normal.mean() > 0.9
    assert np.all(np.abs(got - want)[normal] <= 2.0 ** -11 * np.abs(want)[normal])
    assert np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want))


def test_q2_k_as_q8_0_moves_each_weight_by_at_most_half_a_step():
    from omniinfer.testing.kquant import QUANTIZERS

    rows, cols = 6, 3 * 256
    rng = np.random.default_rng(3)
    for data in (random_blocks(gguf_blocks.BY_NAME["Q2_K"], rows, cols, rng),
                 QUANTIZERS["Q2_K"](rng.standard_normal((rows, cols)).astype(np.float32) * 0.05)):
        got, want = _near("Q2_K", data, rows, cols)
        largest = np.abs(want).reshape(rows, -1, 32).max(axis=2, keepdims=True)
        step = np.broadcast_to(largest / 127 * (1 + 2.0 ** -10), (rows, cols // 32, 32)).reshape(rows, cols)
        assert np.all(np.abs(got - want) <= step / 2 + 1e-12)


def test_a_scale_float16_cannot_hold_is_refused_and_the_cpu_kernel_leaves_it_to_the_reference(monkeypatch):
    """(With float activations, which take the rewrite; with int8 ones the CPU kernel holds the
    file's own d and 6-bit scales, and nothing is refused.)"""
    from omniinfer.quantization.base import KernelRefused, QuantPiece

    data = random_blocks(gguf_blocks.BY_NAME["IQ4_XS"], 1, 256, np.random.default_rng(0))
    data[0, :2] = np.array([60000.0], dtype=np.float16).view(np.uint8)  # d * (s - 32) overflows
    data[0, 2:8] = 0xFF  # s = 63
    with pytest.raises(ValueError, match=r"an IQ4_XS sub-block scale of 1.86e\+06 is not a float16 within 0.00390625"):
        gguf_transcode.transcode("IQ4_XS", torch.from_numpy(data), 256)
    cpu = pytest.importorskip("omniinfer_cpu.quant")
    piece = QuantPiece("gguf:IQ4_XS", (1, 256), {"blocks": torch.from_numpy(data)})
    monkeypatch.setenv(cpu.ACT_ENV, "float")
    with pytest.raises(KernelRefused, match="IQ4_XS sub-block scale"):
        cpu.CpuQuantKernel(piece)
    monkeypatch.setenv(cpu.ACT_ENV, "int8")
    assert cpu.CpuQuantKernel(piece).piece.kind == "cpu:IQ4_XSx8"
