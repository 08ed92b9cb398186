"""The quantized layers' products by rows (kernels/triton/dequant_linear.py): the fused kernels
for a few rows, the weight dequantised then torch's matmul for more. Interpreted on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 without an accelerator), compiled where there is a GPU.

References as the fused kernels' tests use them: ``gguf.quants.dequantize`` for GGUF blocks,
quantization/int_reference.py for n-bit weights; tolerances theirs (the same rounded operands,
float32 sums in another order). int8 weight-only products past the bound are the
ReferenceKernel's (``code * scale`` rounded once to x's dtype, then F.linear), not the fused
kernel's (codes exact, the scale after the sum).
"""

from __future__ import annotations

import pytest
import torch

from omniinfer.kernels import triton as triton_kernels
from omniinfer.quantization import fp8 as fp8_format
from omniinfer.quantization.base import QuantPiece
from omniinfer.quantization.int_reference import int8_linear_reference, wn_linear_reference

pytest.importorskip("triton")
pytest.importorskip("gguf")
from test_triton_gguf_kernels import blocks_of  # noqa: E402
from test_triton_quant_kernels import CASES, close, int8_weight, packed_weight  # noqa: E402

from omniinfer.kernels.triton import dequant_linear as dl  # noqa: E402

INTERPRETED = triton_kernels.interpret_requested()
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"


def on(t):
    return None if t is None else t.to(DEVICE)


def wn(x, p, bias=None, **kw):
    return dl.wn_linear(on(x), on(p.qweight), on(p.scales), on(p.zeros), on(p.g_idx), p.bits,
                        p.group_size, on(bias), **kw).cpu()


@pytest.fixture
def launches(monkeypatch):
    """Which product each call took: 'fused' or 'dequantised'."""
    seen = []
    for name, path in (("gguf_matmul", "fused"), ("wn_matmul", "fused"), ("int8_matmul", "fused"),
                       ("fp8_matmul", "fused"), ("gguf_dequantize", "dequantised"),
                       ("wn_dequantize", "dequantised"), ("int8_dequantize", "dequantised"),
                       ("fp8_dequantize", "dequantised")):
        real = getattr(dl, name)
        monkeypatch.setattr(dl, name, lambda *a, _r=real, _p=path, **k: (seen.append(_p), _r(*a, **k))[1])
    return seen


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("more", [-3, 0, 1, 9])
def test_gguf_rows_take_the_fused_kernel_up_to_the_bound_then_the_dequantised_weight(name, more,
                                                                                     launches):
    bound = dl.gguf_fused_max_m(name)
    assert bound == (8 if name == "Q8_0" else dl.GGUF_FUSED_MAX_M) and bound >= 4
    m = bound + more
    blocks, w = blocks_of(name, 72, 512)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
    out = dl.gguf_linear(on(x), on(blocks), name).cpu()
    close(out, torch.nn.functional.linear(x, w))
    assert launches == ["fused" if m <= bound else "dequantised"]


@pytest.mark.parametrize("case", ["gptq4 g128 asym", "gptq4 g32 sym desc_act"])
@pytest.mark.parametrize("m", [1, 2, 9])
def test_wn_rows_take_the_fused_kernel_up_to_the_bound_then_the_dequantised_weight(case, m,
                                                                                   launches):
    p = packed_weight(case, CASES[case])
    bound = dl.wn_fused_max_m(p.g_idx is not None)
    assert bound == (dl.WN_G_IDX_FUSED_MAX_M if "desc_act" in case else dl.WN_FUSED_MAX_M)
    x = torch.randn(m, CASES[case], generator=torch.Generator().manual_seed(m))
    close(wn(x, p), wn_linear_reference(x, p))
    assert launches == ["fused" if m <= bound else "dequantised"]


@pytest.mark.parametrize("name", ["Q8_0", "Q5_1", "Q3_K", "Q6_K", "IQ4_XS"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gguf_dequantised_products_match_the_reference(name, dtype):
    blocks, w = blocks_of(name, 72, 512, seed=2)
    x = torch.randn(2, 9, 512, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(72).to(dtype)
    out = dl.gguf_linear(on(x), on(blocks), name, on(bias), fused_max_m=0).cpu()
    assert out.shape == (2, 9, 72)
    close(out, torch.nn.functional.linear(x, w.to(dtype), bias))


def test_wide_layers_are_dequantised_in_chunks_of_the_workspace(monkeypatch, launches):
    """A workspace of 64 outputs' weights: 72 outputs in two chunks, the bias split with them."""
    blocks, w = blocks_of("Q6_K", 72, 256, seed=4)
    p = packed_weight("gptq4 g128 asym")
    monkeypatch.setattr(dl, "DEQUANT_WORKSPACE_BYTES", 64 * 256 * 4)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(72)
    close(dl.gguf_linear(on(x), on(blocks), "Q6_K", on(bias)).cpu(),
          torch.nn.functional.linear(x, w, bias))
    close(wn(x, p, bias), wn_linear_reference(x, p, bias))
    assert launches == ["dequantised"] * 4


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_wn_dequantised_products_match_the_reference(case, dtype, launches):
    p = packed_weight(case, CASES[case])
    x = torch.randn(17, CASES[case], generator=torch.Generator().manual_seed(6)).to(dtype)
    close(wn(x, p), wn_linear_reference(x, p))
    assert launches == ["dequantised"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_wn_dequantize_is_the_reference_weight_rounded_once(case):
    """Bit for bit: outputs [8, 72) of W^T (a range that starts inside the first 64-wide tile),
    float32 and each 16-bit dtype the float32 weight rounded once."""
    p = packed_weight(case, CASES[case])
    want = p.dequantize().T  # [K, N] float32
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = dl.wn_dequantize(on(p.qweight), on(p.scales), on(p.zeros), on(p.g_idx), p.bits,
                               p.group_size, CASES[case], dtype, 8, 72).cpu()
        assert got.dtype == dtype and torch.equal(got, want[:, 8:].to(dtype))


def test_bad_arguments_are_named():
    p = packed_weight("gptq4 g128 asym")
    with pytest.raises(ValueError, match=r"outputs \[8, 80\) are not within the weight's 72"):
        dl.wn_dequantize(p.qweight, p.scales, p.zeros, None, 4, 128, 256, torch.float32, 8, 80)
    with pytest.raises(ValueError, match="qweight must be int32"):
        wn(torch.randn(9, 512), p)  # K=512 for a weight of K=256, on the dequantising path
    blocks, _ = blocks_of("Q4_0", 8, 256)
    with pytest.raises(ValueError, match="blocks must be uint8"):
        dl.gguf_linear(on(torch.randn(9, 512)), on(blocks), "Q4_0")


def test_no_rows_make_an_empty_product():
    blocks, _ = blocks_of("Q8_0", 72, 256)
    assert dl.gguf_linear(on(torch.randn(0, 256)), on(blocks), "Q8_0", fused_max_m=-1).shape == (0, 72)
    assert dl.gguf_linear(on(torch.randn(0, 256)), on(blocks), "Q8_0").shape == (0, 72)


def int8(x, w, bias=None, **kw):
    return dl.int8_linear(on(x), on(w.weight), on(w.weight_scale), on(w.input_scale),
                          w.quantize_activations, on(bias), **kw).cpu()


def int8_reference_kernel(x, w, bias=None):
    """The ReferenceKernel's product: the weight ``code * scale`` rounded once to x's dtype."""
    return torch.nn.functional.linear(x, w.dequantize().to(x.dtype), bias)


@pytest.mark.parametrize("more", [-127, 0, 1])
@pytest.mark.parametrize("mode", ["w8a16", "w8a8"])
def test_int8_weight_only_rows_take_the_fused_kernel_up_to_the_bound(mode, more, launches):
    """W8A16 past INT8_FUSED_MAX_M rows is dequantised; W8A8 keeps its exact int8 product."""
    w = int8_weight(k=64, quantize_activations=mode == "w8a8")
    m = dl.INT8_FUSED_MAX_M + more
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    dequantised = mode == "w8a16" and more > 0
    want = (int8_reference_kernel if dequantised else int8_linear_reference)(x, w)
    close(int8(x, w), want)
    assert launches == ["dequantised" if dequantised else "fused"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int8_dequantised_products_match_the_reference_kernel(dtype, launches, monkeypatch):
    """Chunks of 64 outputs (a small workspace): 72 outputs in two, the bias split with them."""
    monkeypatch.setattr(dl, "DEQUANT_WORKSPACE_BYTES", 64 * 200 * torch.tensor([], dtype=dtype).element_size())
    w = int8_weight(quantize_activations=False)
    x = torch.randn(2, 9, 200, generator=torch.Generator().manual_seed(7)).to(dtype)
    bias = torch.randn(72).to(dtype)
    out = int8(x, w, bias, fused_max_m=0)
    assert out.shape == (2, 9, 72)
    close(out, int8_reference_kernel(x, w, bias))
    assert launches == ["dequantised"] * 2


def test_int8_dequantize_is_the_reference_weight_rounded_once():
    w = int8_weight(k=300, quantize_activations=False)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = dl.int8_dequantize(on(w.weight[5:]), on(w.weight_scale[5:]), dtype).cpu()
        assert got.dtype == dtype and torch.equal(got, w.dequantize()[5:].to(dtype))


def test_int8_bad_arguments_are_named():
    w = int8_weight(quantize_activations=False)
    with pytest.raises(ValueError, match=r"weight must be int8 \[N, 256\] with contiguous rows"):
        int8(torch.randn(300, 256), w)  # K=256 for a weight of K=200, on the dequantising path
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[72\]"):
        dl.int8_dequantize(w.weight, w.weight_scale.half(), torch.float16)


# ---- FP8 (kernels/triton/fp8_gemm.py): e4m3 codes with a float32 scale a row and block -----------
def fp8_weight(n=72, k=300, scale_cols=128, seed=8):
    """Random e4m3 codes (every code but the two NaNs) [n, k] and scales [n, ceil(k / scale_cols)]
    as quantization/fp8.py's piece holds them, and that piece's float32 weight."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32)
    q = torch.where(q & 0x7F == 0x7F, q - 1, q).to(torch.uint8)
    scale = torch.rand(n, -(-k // scale_cols), generator=gen) * 0.02 + 2 ** -12
    kind = fp8_format.fp8_kind(None if scale_cols >= k else scale_cols)
    w = fp8_format._dequantize(QuantPiece(kind, (n, k), {"q": q, "scale": scale}))
    return q, scale, w


def fp8(x, q, scale, scale_cols, bias=None, **kw):
    return dl.fp8_linear(on(x), on(q), on(scale), scale_cols, on(bias), **kw).cpu()


@pytest.mark.parametrize("more", [-3, 0, 1, 5])
def test_fp8_rows_take_the_fused_kernel_up_to_the_bound_then_the_dequantised_weight(more, launches):
    """Up to 8 rows a program (9 rows: two row tiles); K 300, its last block ragged; K split."""
    q, scale, w = fp8_weight()
    m = dl.FP8_FUSED_MAX_M + more
    x = torch.randn(m, 300, generator=torch.Generator().manual_seed(m))
    close(fp8(x, q, scale, 128), torch.nn.functional.linear(x, w))
    assert launches == ["fused" if more <= 0 else "dequantised"]


@pytest.mark.parametrize("shape", [(64, 512, 128), (72, 300, 300), (72, 320, 32), (64, 256, 256)],
                         ids=["even, blocks of 128", "one scale a row", "blocks of 32", "one block"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fused_max_m", [1 << 30, 0], ids=["fused", "dequantised"])
def test_fp8_products_match_the_reference(shape, dtype, fused_max_m):
    """Both paths, every activation dtype, with a bias: the GEMV's float32 sums of x times the
    float32 weight, the dequantised path's the reference's weight rounded to x's dtype."""
    n, k, scale_cols = shape
    q, scale, w = fp8_weight(n, k, scale_cols, seed=k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9)).to(dtype)
    bias = torch.randn(n).to(dtype)
    out = fp8(x, q, scale, scale_cols, bias, fused_max_m=fused_max_m)
    close(out, torch.nn.functional.linear(x, w.to(dtype), bias))


def test_fp8_dequantize_is_the_reference_weight_rounded_once():
    """Bit for bit, every code in every position of a block (the NaN codes aside, which read as
    +-480 x the scale: no checkpoint's weight holds them), outputs [5, 72)."""
    q, scale, w = fp8_weight(72, 512, 128, seed=3)
    q[:, :256] = torch.arange(256, dtype=torch.uint8)
    nan = (q & 0x7F) == 0x7F
    w = fp8_format._dequantize(QuantPiece("fp8:b128", (72, 512), {"q": q, "scale": scale}))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = dl.fp8_dequantize(on(q), on(scale), 128, dtype, 5, 72).cpu()
        assert got.dtype == dtype and got.shape == (67, 512)
        ok = ~nan[5:]
        assert torch.equal(got[ok], w[5:].to(dtype)[ok])
        assert torch.equal(got[~ok].float().abs(), (480 * scale[5:].repeat_interleave(128, 1))[~ok].to(dtype).float())


def test_fp8_wide_layers_are_dequantised_in_chunks_of_the_workspace(monkeypatch, launches):
    monkeypatch.setattr(dl, "DEQUANT_WORKSPACE_BYTES", 64 * 300 * 4)
    q, scale, w = fp8_weight()
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(72)
    close(fp8(x, q, scale, 128, bias), torch.nn.functional.linear(x, w, bias))
    assert launches == ["dequantised"] * 2


def test_fp8_bad_arguments_are_named():
    q, scale, _ = fp8_weight()
    with pytest.raises(ValueError, match=r"q must be uint8 \[N, 512\] with contiguous rows"):
        fp8(torch.randn(2, 512), q, scale, 128)
    with pytest.raises(ValueError, match=r"q must be uint8 \[N, 300\]"):
        fp8(torch.randn(2, 300), q.view(torch.int8), scale, 128)
    with pytest.raises(ValueError, match=r"scale must be float32 \[72, 3\] \(a scale per row and block of 128"):
        fp8(torch.randn(9, 300), q, scale[:, :2], 128)
    with pytest.raises(ValueError, match=r"scale_cols=80: the kernels take scale blocks of a multiple of 32"):
        fp8(torch.randn(2, 300), q, torch.ones(72, 4), 80)
    with pytest.raises(ValueError, match=r"outputs \[8, 80\) are not within the weight's 72"):
        dl.fp8_dequantize(q, scale, 128, torch.float32, 8, 80)
    assert fp8(torch.randn(0, 300), q, scale, 128).shape == (0, 72)
