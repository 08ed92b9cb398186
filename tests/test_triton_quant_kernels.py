"""The quantized-GEMM Triton kernels (kernels/triton/quant_gemm.py, int8_gemm.py) against the
torch reference (quantization/int_reference.py): interpreted on the CPU (tests/conftest.py sets
TRITON_INTERPRET=1 without an accelerator), compiled where there is a GPU.

Weights come from the independent construction (testing/quant_weights.py) through each
format's conversion to the kernels' layout. Shapes are small (the interpreter is slow) but
every path is taken: GEMV rows 1-8 with split K, GEMM rows, odd M / N / K tails, group sizes
32 / 64 / 128 / one group, zero points or the midpoint, act-order g_idx, 4 and 8 bits, float16
/ bfloat16 / float32 activations, bias.

Tolerance: the GEMM and the reference multiply the same rounded operands and accumulate in
float32; only the order of the sums differs. The GEMV (1-8 rows) multiplies the float32 weight
unrounded: each weight then differs from the reference's by at most half a unit in the last
place of x's dtype, and the sums by much less than the largest output's unit (errors of both
signs). So outputs agree to the output dtype's rounding (one unit in the last place of the
largest output, relative: 2**-10 fp16, 2**-7 bf16) and to 1e-5 in float32.
"""

from __future__ import annotations

import pytest
import torch

from omniinfer.kernels import triton as triton_kernels
from omniinfer.quantization.int_formats import parse_quantization_config
from omniinfer.quantization.int_layouts import Int8Weight
from omniinfer.quantization.int_reference import (
    int8_linear_reference,
    quantize_int8_rows_reference,
    wn_linear_reference,
)
from omniinfer.testing import quant_weights as qw

pytest.importorskip("triton")
from omniinfer.kernels.triton.int8_gemm import int8_matmul, int8_tiles, quantize_int8_rows  # noqa: E402
from omniinfer.kernels.triton.quant_gemm import wn_matmul, wn_tiles  # noqa: E402

INTERPRETED = triton_kernels.interpret_requested()
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
RELATIVE = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7, torch.float32: 1e-5}
N = 72  # not a multiple of the 64-wide output tile


def close(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=0,
                               atol=RELATIVE[ref.dtype] * scale)


def ct(bits, group_size, symmetric, actorder=None):
    strategy = "channel" if group_size == -1 else "group"
    return parse_quantization_config({
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": bits, "symmetric": symmetric, "strategy": strategy,
            "group_size": None if group_size == -1 else group_size, "actorder": actorder}}},
    }).layer_format("layer")


def packed_weight(case: str, k: int = 256, seed: int = 0):
    """(PackedIntWeight, what it holds) for one named case, via the format's own conversion."""
    w = torch.randn(N, k, generator=torch.Generator().manual_seed(seed))
    if case == "gptq4 g128 asym":
        q = qw.rtn(w, 4, 128, sym=False)
        fmt = parse_quantization_config(dict(quant_method="gptq", bits=4, group_size=128,
                                             sym=False)).layer_format("layer")
        tensors = qw.gptq_tensors(q, 4)
    elif case == "gptq4 g32 sym desc_act":
        q = qw.rtn(w, 4, 32, sym=True, act_order=True)
        fmt = parse_quantization_config(dict(quant_method="gptq", bits=4, group_size=32,
                                             desc_act=True)).layer_format("layer")
        tensors = qw.gptq_tensors(q, 4)
    elif case == "awq g64":
        q = qw.rtn(w, 4, 64, sym=False)
        fmt = parse_quantization_config(dict(quant_method="awq", bits=4, group_size=64,
                                             version="gemm")).layer_format("layer")
        tensors = qw.awq_tensors(q)
    elif case == "gptq8 channel sym":
        q = qw.rtn(w, 8, -1, sym=True)
        fmt = parse_quantization_config(dict(quant_method="gptq", bits=8,
                                             group_size=-1)).layer_format("layer")
        tensors = qw.gptq_tensors(q, 8)
    elif case == "ct w8a16 g128 asym":
        q = qw.rtn(w, 8, 128, sym=False, scale_dtype=torch.bfloat16)
        fmt, tensors = ct(8, 128, False), qw.ct_packed_tensors(q, 8, False)
    elif case == "ct w4a16 g32 asym actorder":  # k=200: a ragged last word and group
        q = qw.rtn(w, 4, 32, sym=False, act_order=True, scale_dtype=torch.bfloat16)
        fmt = ct(4, 32, False, actorder="group")
        tensors = qw.ct_packed_tensors(q, 4, False, g_idx=True)
    elif case == "ct w4a16 channel sym":
        q = qw.rtn(w, 4, -1, sym=True, scale_dtype=torch.bfloat16)
        fmt, tensors = ct(4, -1, True), qw.ct_packed_tensors(q, 4, True)
    else:
        raise KeyError(case)
    packed = fmt.to_kernel_layout(tensors, N, k)
    assert torch.equal(packed.dequantize(), q.expected)
    return packed


CASES = {"gptq4 g128 asym": 256, "gptq4 g32 sym desc_act": 256, "awq g64": 256,
         "gptq8 channel sym": 256, "ct w8a16 g128 asym": 256, "ct w4a16 g32 asym actorder": 200,
         "ct w4a16 channel sym": 200}


def run_wn(x, p, bias=None):
    to = dict(device=DEVICE)
    return wn_matmul(x.to(**to), p.qweight.to(**to), p.scales.to(**to),
                     None if p.zeros is None else p.zeros.to(**to),
                     None if p.g_idx is None else p.g_idx.to(**to), p.bits, p.group_size,
                     None if bias is None else bias.to(**to)).cpu()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 5, 8, 17])
def test_weight_only_kernels_match_the_reference(case, dtype, m):
    k = CASES[case]
    p = packed_weight(case, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    close(run_wn(x, p), wn_linear_reference(x, p))


def test_decode_rows_split_k_and_prefill_rows_do_not():
    gemv = wn_tiles(4, 4096, 4096, 128, False, 4)
    assert not gemv["USE_DOT"] and gemv["split_k"] > 1 and gemv["BLOCK_M"] == 4
    assert gemv["k_per_split"] * gemv["split_k"] >= 4096 and gemv["TILE_IN_ONE_GROUP"]
    gemm = wn_tiles(512, 4096, 4096, 128, False, 4)
    assert gemm["USE_DOT"] and gemm["split_k"] == 1 and gemm["BLOCK_M"] == 64
    assert not wn_tiles(512, 4096, 4096, 128, True, 4)["TILE_IN_ONE_GROUP"]  # g_idx: gathered
    assert wn_tiles(1, 72, 256, 128, False, 4)["split_k"] == 2  # the tests' own shapes split too


@pytest.mark.parametrize("m", [3, 70])
def test_bias_batch_dims_and_two_row_tiles(m):
    p = packed_weight("gptq4 g128 asym")
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bias = torch.randn(N).to(torch.bfloat16)
    close(run_wn(x, p, bias), wn_linear_reference(x, p, bias))
    y = run_wn(x.view(1, m, 256), p)
    assert y.shape == (1, m, N)


def test_weight_only_refuses_a_qweight_of_the_wrong_shape():
    p = packed_weight("gptq4 g128 asym")
    with pytest.raises(ValueError, match=r"qweight must be int32 \[16, N\] for K=128"):
        run_wn(torch.randn(2, 128), p)


# ---- int8 ----------------------------------------------------------------------------------------
def int8_weight(k=200, static=None, quantize_activations=True):
    tensors, _ = qw.ct_int8_tensors(torch.randn(N, k, generator=torch.Generator().manual_seed(3)),
                                    static)
    return Int8Weight(tensors["weight"], tensors["weight_scale"].float().flatten(),
                      tensors.get("input_scale"), quantize_activations)


def run_int8(x, w, bias=None):
    to = dict(device=DEVICE)
    return int8_matmul(x.to(**to), w.weight.to(**to), w.weight_scale.to(**to),
                       None if w.input_scale is None else w.input_scale.to(**to),
                       w.quantize_activations, None if bias is None else bias.to(**to)).cpu()


@pytest.mark.parametrize("mode", ["w8a8 dynamic", "w8a8 static", "w8a16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_int8_kernels_match_the_reference(mode, dtype, m):
    w = int8_weight(static=0.02 if mode == "w8a8 static" else None,
                    quantize_activations=mode != "w8a16")
    x = torch.randn(m, 200, generator=torch.Generator().manual_seed(m)).to(dtype)
    bias = torch.randn(N).to(dtype) if m == 5 else None
    close(run_int8(x, w, bias), int8_linear_reference(x, w, bias))


@pytest.mark.parametrize("mode", ["w8a8 dynamic", "w8a16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 20])
def test_int8_kernels_split_k_where_the_output_tiles_are_few(mode, dtype, m):
    """72 outputs are 2 tiles: K=1000 is split into float32 partial sums, which add (with the
    bias) to the reference's product."""
    cfg = int8_tiles(m, N, 1000)
    assert cfg["split_k"] > 1 and cfg["k_per_split"] % cfg["BLOCK_K"] == 0
    assert cfg["split_k"] * cfg["k_per_split"] >= 1000 > (cfg["split_k"] - 1) * cfg["k_per_split"]
    w = int8_weight(k=1000, quantize_activations=mode != "w8a16")
    x = torch.randn(m, 1000, generator=torch.Generator().manual_seed(m)).to(dtype)
    bias = torch.randn(N).to(dtype)
    close(run_int8(x, w, bias), int8_linear_reference(x, w, bias))


@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("n,k,even", [(N, 200, False), (128, 512, True)])
def test_the_one_row_int8_gemv_is_exact_per_weight_and_matches_the_reference(n, k, even, w8a8,
                                                                             monkeypatch):
    """One int8 row runs int8_gemv.py (int32 words, codes made floats in place; W8A8's sums
    exact integers): times one-hot rows it gives the reference's column exactly (W8A16: code *
    scale), for every seventh input; with random rows it matches the reference, masked (72
    outputs, K 200) and unmasked (EVEN)."""
    from omniinfer.kernels.triton import int8_gemm

    launches = []
    launch = int8_gemm.launch_weight_only
    monkeypatch.setattr(int8_gemm, "launch_weight_only", lambda *a, **kw: (
        launches.append((kw["ONE_ROW"], kw["EVEN"])) or launch(*a, **kw)))
    codes = torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(7),
                          dtype=torch.int8)
    w = Int8Weight(codes, torch.rand(n, generator=torch.Generator().manual_seed(8)) + 0.01,
                   None, w8a8)
    for i in range(0, k, 7):
        x = torch.zeros(1, k)
        x[0, i] = 1.0
        assert torch.equal(run_int8(x, w), int8_linear_reference(x, w)), i
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(9)).to(dtype)
        close(run_int8(x, w), int8_linear_reference(x, w))
    assert set(launches) == {(True, even)}


def test_a_w8a8_split_too_long_for_exact_float32_sums_takes_the_dot_tile(monkeypatch):
    """The one-row GEMV's W8A8 sums are exact while a split covers at most EXACT_SPLIT inputs;
    an unsplit K of 8256 (one program: `programs` 1) goes to the int32 tl.dot tile instead,
    W8A16 still to the GEMV; both match the reference."""
    from omniinfer.kernels.triton import int8_gemm
    from omniinfer.kernels.triton.int8_gemv import EXACT_SPLIT

    k = 8256
    assert k > EXACT_SPLIT
    launches = []
    launch, tiles = int8_gemm.launch_weight_only, int8_gemm.one_row_tiles
    monkeypatch.setattr(int8_gemm, "launch_weight_only", lambda *a, **kw: (
        launches.append(kw["ONE_ROW"]) or launch(*a, **kw)))
    monkeypatch.setattr(int8_gemm, "one_row_tiles", lambda n, k: tiles(n, k, programs=1))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(10))
    for w8a8 in (True, False):
        w = int8_weight(k=k, quantize_activations=w8a8)
        close(run_int8(x, w), int8_linear_reference(x, w))
    assert launches == [False, True]


def test_int8_tiles_split_only_what_leaves_the_device_idle():
    """Llama-3-8B's gate_up (448 output tiles) runs unsplit; its down (64 tiles) in 8 splits."""
    assert int8_tiles(1, 28672, 4096)["split_k"] == 1
    assert int8_tiles(1, 4096, 14336)["split_k"] == 8
    assert int8_tiles(512, 4096, 14336)["split_k"] == 1  # 8 row tiles x 64


@pytest.mark.parametrize("static", [None, 0.01])
def test_activation_quantization_is_the_reference_bit_for_bit(static):
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    x[0, :2] = torch.tensor([127.0, 0.5])  # scale 1 in row 0: 0.5 is a tie, to even (0)
    x[1, :2] = torch.tensor([-127.0, -2.5])  # -2.5 goes to -2
    scale = None if static is None else torch.tensor([static])
    q, s = quantize_int8_rows(x.to(DEVICE), None if scale is None else scale.to(DEVICE))
    q_ref, s_ref = quantize_int8_rows_reference(x, scale)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    if static is None:
        assert q_ref[0, 1] == 0 and q_ref[1, 1] == -2
