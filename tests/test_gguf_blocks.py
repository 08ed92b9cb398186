"""Every GGUF tensor type dequantises bit for bit like the gguf package's own
`gguf.quants.dequantize`, on random blocks (any bytes are a valid block once its float16 scales
are finite) and on blocks `gguf.quants.quantize` makes from random weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from omniinfer.quantization import gguf_blocks  # noqa: E402
from omniinfer.testing.kquant import SCALE_OFFSETS, random_blocks  # noqa: E402


@pytest.mark.parametrize("name", sorted(SCALE_OFFSETS))
def test_random_blocks_bit_for_bit(name):
    kind = gguf_blocks.BY_NAME[name]
    rng = np.random.default_rng(kind.code)
    rows, cols = 7, 3 * 256
    data = random_blocks(kind, rows, cols, rng)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name]).reshape(rows, cols)
    got = gguf_blocks.dequantize(torch.from_numpy(data), kind, cols)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert np.array_equal(got.numpy().view(np.int32), want.astype(np.float32).view(np.int32))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_quantized_weights_bit_for_bit(name):
    kind = gguf_blocks.BY_NAME[name]
    qtype = gguf.GGMLQuantizationType[name]
    weights = np.random.default_rng(3).standard_normal((5, 256)).astype(np.float32) * 0.1
    data = gguf.quants.quantize(weights, qtype)
    raw = data.view(np.uint8).reshape(5, -1)
    assert raw.shape[1] == kind.row_bytes(256)
    want = gguf.quants.dequantize(data, qtype).reshape(5, 256)
    got = gguf_blocks.dequantize(torch.from_numpy(raw.copy()), kind, 256)
    assert np.array_equal(got.numpy().view(np.int32), want.astype(np.float32).view(np.int32))


def test_an_unsupported_type_is_named():
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ffn_up.weight' has GGUF tensor type 35 \(TQ2_0\), "
                                         r"which omniinfer does not load; supported: F32, F16"):
        gguf_blocks.type_of(35, "blk.0.ffn_up.weight")


# the round-to-nearest quantisers' error, rms relative to the weights' (N(0, 1) weights): bits
RTN_RMS = {"Q2_K": 0.4, "Q3_K": 0.25, "Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.03, "IQ4_NL": 0.12, "IQ4_XS": 0.12}


@pytest.mark.parametrize("name", sorted(RTN_RMS))
def test_the_test_quantisers_write_blocks_gguf_reads_back_near_the_weights(name):
    """testing/kquant.py's quantisers (the gguf package makes none of these types) against the
    package's own dequantisation: near the weights (a wrong packing is off by the weights' size),
    and ours equal to it bit for bit on them."""
    from omniinfer.testing.kquant import QUANTIZERS

    weights = np.random.default_rng(4).standard_normal((6, 512)).astype(np.float32)
    data = QUANTIZERS[name](weights)
    assert data.dtype == np.uint8 and data.shape == (6, gguf_blocks.BY_NAME[name].row_bytes(512))
    back = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name]).reshape(6, 512).astype(np.float32)
    assert np.sqrt(((back - weights) ** 2).mean()) < RTN_RMS[name]
    got = gguf_blocks.dequantize(torch.from_numpy(data), gguf_blocks.BY_NAME[name], 512)
    assert np.array_equal(got.numpy().view(np.int32), back.view(np.int32))


class _HostReads(torch.overrides.TorchFunctionMode):
    """Records what a computation on a non-CPU device reads from the host: tensors made from
    Python data (torch.tensor, as_tensor, from_numpy, frombuffer) and, through the dispatch mode
    below, any op given a CPU tensor (a copy to the device, a CPU table indexed by device codes)."""

    MAKERS = (torch.tensor, torch.as_tensor, torch.from_numpy, torch.frombuffer)

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.MAKERS:
            self.seen.append(f"{func.__name__}(...)")
        return func(*args, **(kwargs or {}))


class _CpuOperands(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in leaves):
            self.seen.append(f"{func} on a CPU tensor")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", gguf_blocks.QUANTIZED)
def test_dequantising_again_reads_nothing_from_the_host(name):
    """A decode step replayed from a CUDA graph looks quantised embedding rows up with this
    dequantisation, and a host-to-device copy during the graph's capture is refused ("Cannot copy
    between CPU and CUDA tensors during CUDA graph capture", met on an H200 with Q3_K and IQ4_XS
    embeddings). On the meta device every such read shows: after a first call (the warm-up,
    which may copy a table once), a second one reads nothing from the host."""
    kind = gguf_blocks.BY_NAME[name]
    data = torch.empty(3, kind.row_bytes(256), dtype=torch.uint8, device="meta")
    gguf_blocks.dequantize(data, kind, 256)
    with _HostReads() as host, _CpuOperands(host.seen):
        out = gguf_blocks.dequantize(data, kind, 256)
    assert out.shape == (3, 256) and out.device.type == "meta"
    assert host.seen == []
