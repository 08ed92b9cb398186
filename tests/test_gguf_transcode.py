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
