"""GGUF blocks rewritten as another type (quantization/gguf_transcode.py) dequantise, by the
`gguf` package's own `gguf.quants.dequantize`, to the same float32 numbers bit for bit: random
blocks (every code, scale and high-bit pattern; every grid entry and sign of the lattice types)
and blocks of random weights; the requantised ones within half a step."""

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
    if name in gguf_transcode.LATTICE_AS:  # (exact where d / 8 is a normal float16: below, test_a_tiny_lattice_d)
        _set_d(name, data, np.where(np.abs(_d(name, data)) < 2.0 ** -10, np.float16(0.01), _d(name, data)))
    target, out = gguf_transcode.transcode(name, torch.from_numpy(data), cols)
    assert target == gguf_transcode.EXACTLY_AS[name]
    assert out.shape == (rows, gguf_blocks.BY_NAME[target].row_bytes(cols)) and out.dtype == torch.uint8
    want = dequantized(data, name, rows, cols)
    got = dequantized(out.numpy(), target, rows, cols)
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("name", sorted(set(gguf_transcode.EXACTLY_AS) - set(gguf_transcode.LATTICE_AS)))
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


@pytest.mark.parametrize("name", ["Q2_K", "IQ2_XXS", "IQ2_XS", "IQ2_S"])
def test_requantised_as_q8_0_each_weight_moves_by_at_most_half_a_step(name):
    """(The gguf package makes no blocks of these: random blocks, and Q2_K's of random weights.)"""
    from omniinfer.testing.kquant import QUANTIZERS

    rows, cols = 6, 3 * 256
    rng = np.random.default_rng(3)
    sources = [random_blocks(gguf_blocks.BY_NAME[name], rows, cols, rng)]
    if name in QUANTIZERS:
        sources.append(QUANTIZERS[name](rng.standard_normal((rows, cols)).astype(np.float32) * 0.05))
    for data in sources:
        got, want = _near(name, data, rows, cols)
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


def _d(name: str, data: np.ndarray) -> np.ndarray:
    from omniinfer.quantization import gguf_iq

    blocks = torch.from_numpy(data).reshape(-1, gguf_blocks.BY_NAME[name].block_bytes)
    raw = gguf_iq.iq1_m_d(blocks) if name == "IQ1_M" else blocks[:, :2]
    return raw.contiguous().numpy().view(np.float16).reshape(-1)


def _set_d(name: str, data: np.ndarray, d: np.ndarray) -> None:
    blocks = data.reshape(-1, gguf_blocks.BY_NAME[name].block_bytes)
    bits = d.astype(np.float16).view(np.uint16)
    if name != "IQ1_M":
        blocks[:, :2] = bits.view(np.uint8).reshape(-1, 2)
        return
    for i in range(4):  # (its d's nibbles: the scale words' top ones)
        blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | ((bits >> (4 * i)) & 0x0F).astype(np.uint8) << 4


@pytest.mark.parametrize("name", ["IQ3_XXS", "IQ1_S", "IQ1_M"])
def test_a_tiny_lattice_d_moves_by_at_most_2_to_the_minus_8_or_is_refused(name):
    """d / 8 (or 2) below float16's normal range is a subnormal: rounded, each weight moves by at
    most 2**-8 of itself; a d whose rewrite would move more is refused."""
    data = random_blocks(gguf_blocks.BY_NAME[name], 4, 256, np.random.default_rng(0))
    _set_d(name, data, np.array([3e-4, -2.5e-4, 1.2e-3, 6.1e-5]))
    target, out = gguf_transcode.transcode(name, torch.from_numpy(data), 256)
    got, want = dequantized(out.numpy(), target, 4, 256), dequantized(data, name, 4, 256)
    assert not np.array_equal(got, want) and np.all(np.abs(got - want) <= 2.0 ** -8 * np.abs(want))
    _set_d(name, data, np.array([2.0 ** -24] * 4))  # the smallest subnormal
    with pytest.raises(ValueError, match=rf"an {name} block's d is too small for a float16 d / \d within 0.00390625"):
        gguf_transcode.transcode(name, torch.from_numpy(data), 256)


def test_iq2_xxs_as_q8_0_keeps_its_codes_and_rounds_only_its_scale():
    from omniinfer.quantization import gguf_iq

    data = random_blocks(gguf_blocks.BY_NAME["IQ2_XXS"], 4, 512, np.random.default_rng(5))
    got, want = _near("IQ2_XXS", data, 4, 512)
    scale, _ = gguf_iq.parts("IQ2_XXS", torch.from_numpy(data).reshape(-1, 66))
    normal = np.repeat((scale.abs() >= 2.0 ** -14).reshape(4, -1).numpy(), 32, axis=1)
    assert normal.mean() > 0.9
    assert np.all(np.abs(got - want)[normal] <= 2.0 ** -11 * np.abs(want)[normal])
