"""The CPU plugin's quantised products (omni_qlinear) at every ISA level this CPU runs, against
the core's reference (dequantise as gguf.quants does, then multiply), and in the engine; with
float activations and with activations rounded to int8 blocks (up to 8 rows, and Q4_0 at any row
count; against x rounded the same way)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from omniinfer.quantization import gguf_blocks, int8  # noqa: E402
from omniinfer.quantization.base import QuantPiece, dequantize_piece  # noqa: E402
from omniinfer.testing import kquant  # noqa: E402
from omniinfer_cpu.quant import ACT_ENV, CpuQuantKernel, activation_mode  # noqa: E402

KINDS = ["gguf:Q8_0", "gguf:Q4_0", "gguf:Q4_K", "gguf:Q6_K", "int8", "gguf:Q4_1", "gguf:Q5_0", "gguf:Q5_1",
         "gguf:Q5_K", "gguf:Q3_K", "gguf:IQ4_NL", "gguf:IQ4_XS", "gguf:Q2_K"]
# (Q3_K, IQ4_NL, IQ4_XS and Q2_K with float activations: as the Q6_K / Q8_0 they are rewritten to)
NEARLY = ("gguf:IQ4_XS", "gguf:Q2_K")  # (whose rewrites move the numbers: tests/test_gguf_transcode.py)
GGUF_KINDS = [k for k in KINDS if k.startswith("gguf:")]


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
def test_qlinear_matches_the_reference(isa_level, kind, dtype, monkeypatch):
    monkeypatch.setenv(ACT_ENV, "float")
    gen = torch.Generator().manual_seed(KINDS.index(kind))
    for rows, cols in ((37, 512), (5, 256)):
        weight = torch.randn(rows, cols, generator=gen) * 0.05
        piece = piece_of(kind, weight)
        assert CpuQuantKernel.unavailable(kind, piece.shape) is None
        kernel = CpuQuantKernel(piece)
        assert kernel.name == f"cpu ({isa_level.level.name}, float activations)"
        w = dequantize_piece(kernel.piece if kind in NEARLY else piece)
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
    assert CpuQuantKernel.unavailable("gguf:Q5_K", (8, 384)) == "384 columns are not whole blocks"
    assert CpuQuantKernel.unavailable("gguf:Q5_0", (8, 48)) == "48 columns are not whole blocks"
    # Q3_K, IQ4_NL, IQ4_XS and Q2_K run as the Q6_K and Q8_0 blocks they are rewritten to
    assert CpuQuantKernel.unavailable("gguf:Q3_K", (8, 256)) is None
    assert CpuQuantKernel.unavailable("gguf:IQ4_NL", (8, 64)) is None
    assert CpuQuantKernel.unavailable("gguf:Q2_K", (8, 256)) is None
    # every GGUF block type omniinfer loads runs here (llama.cpp's Q4_K_M and Q5_K_M files fall
    # back to Q5_0 / Q5_1 / Q8_0 where a row is not whole 256-blocks: Qwen2.5-0.5B's 896 columns)
    from omniinfer.quantization import gguf_blocks

    blocks = {f"gguf:{t.name}" for t in gguf_blocks.TYPES.values() if t.block > 1}
    assert blocks <= set(CpuQuantKernel.kinds)


def int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as quant_q8.c rounds it, back in float: blocks of 32, d = max |x| / 127 (float32),
    q = round(x * (1 / d)) ties to even, x ~ q * d."""
    v = x.float().reshape(x.shape[0], -1, 32)
    d = v.abs().amax(-1, keepdim=True) / torch.tensor(127.0)
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(v * inv) * d).reshape(x.shape)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_activations_match_x_rounded_the_same_way(isa_level, kind, dtype, monkeypatch):
    monkeypatch.setenv(ACT_ENV, "int8")
    gen = torch.Generator().manual_seed(10 + KINDS.index(kind))
    for rows, cols in ((37, 512), (5, 256)):
        weight = torch.randn(rows, cols, generator=gen) * 0.05
        piece = piece_of(kind, weight)
        kernel = CpuQuantKernel(piece)
        assert kernel.name == f"cpu ({isa_level.level.name}, int8 activations)"
        w = dequantize_piece(piece).double()
        for m in (1, 2, 3, 5, 8, 9, 70, 96, 97):
            x = torch.randn(m, cols + 8, generator=gen)[:, 4:4 + cols].to(dtype)
            x[0, :32] *= 50  # one block far larger than the rest: its own scale
            got = kernel.apply(x)
            exact = F.linear(x.double(), w)
            # (more rows: float panels; GGUF's groups of 8: int8; int8 rows: int8 up to 96, quant.c's I8_DOT_ROWS)
            rounded = m <= 8 or kind.startswith("gguf:") or (kind == "int8" and m <= 96)
            want = F.linear(int8_blocks(x).double(), w) if rounded else exact
            assert got.dtype == dtype and got.shape == (m, rows)
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=1e-4)
                if rounded:  # (and it is the rounded x that was multiplied: the float product is further away)
                    assert (got.double() - want).abs().max() < 0.2 * (exact - want).abs().max()
            else:
                big = max(1.0, float(want.abs().max()))  # (row 0 is 50 times larger: bfloat16's steps are too)
                torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=2e-2 * big, rtol=1e-2)


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"])
@pytest.mark.parametrize("activations", ["float", "int8"])
def test_the_lattice_types_run_as_their_rewrite(isa_level, name, activations, monkeypatch):
    """llama.cpp's IQ1/IQ2/IQ3 (random blocks: every grid entry and sign) rewritten at load as Q6_K
    (exactly) or Q8_0 (within half a step) and run by that type's kernel, against the reference on
    the file's own blocks."""
    from omniinfer.quantization.gguf_transcode import LATTICE_AS

    monkeypatch.setenv(ACT_ENV, activations)
    kind = gguf_blocks.BY_NAME[name]
    rows, cols = 37, 512
    blocks = torch.from_numpy(kquant.random_blocks(kind, rows, cols, np.random.default_rng(kind.code)))
    piece = QuantPiece(f"gguf:{name}", (rows, cols), {"blocks": blocks})
    assert CpuQuantKernel.unavailable(piece.kind, piece.shape) is None
    kernel = CpuQuantKernel(piece)
    assert kernel.name.endswith(f"activations, as {LATTICE_AS[name]})")
    w = dequantize_piece(piece).double()
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(kind.code))
    got = kernel.apply(x).double()
    want = F.linear(int8_blocks(x).double() if activations == "int8" else x.double(), w)
    # Q6_K: float32 sums; Q8_0: each weight within half a step (1/254 of its 32's largest)
    near = 0 if LATTICE_AS[name] == "Q6_K" else 1 / 254
    bound = F.linear(x.abs().double(), w.abs()) * (near + 1e-5) + 1e-5
    assert ((got - want).abs() <= bound).all()


def test_the_activation_mode_is_checked(monkeypatch):
    monkeypatch.setenv(ACT_ENV, "fp8")
    with pytest.raises(ValueError, match="OMNIINFER_CPU_QUANT_ACTIVATIONS='fp8' is not one of int8, float"):
        activation_mode()
    monkeypatch.setenv(ACT_ENV, "float")
    assert activation_mode() == "float"
    monkeypatch.delenv(ACT_ENV)
    assert activation_mode() == "int8"


@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_rows_repacked_in_groups_of_8(isa_level, kind, monkeypatch):
    """int8 activations: GGUF rows in groups of 8 (cpu:Q4_0x8 ... cpu:Q3_Kx8; every type, those
    rewritten for float activations too), any row count (a last group padded), the same sums as x
    rounded to int8 gives; the repacked piece holds the file's bytes, and dequantises and narrows
    back to the very rows (a tied embedding reads them); at every row count."""
    from omniinfer.quantization.base import narrow_piece
    from omniinfer_cpu import quant_x8
    from omniinfer_cpu.quant import TRANSCODED, X8_ONLY

    monkeypatch.setenv(ACT_ENV, "int8")
    gen = torch.Generator().manual_seed(7)
    for rows in (8, 13, 37):
        weight = torch.randn(rows, 256, generator=gen) * 0.05
        piece = piece_of(kind, weight)
        kernel = CpuQuantKernel(piece)
        blocks = piece.tensors["blocks"]
        assert kind not in TRANSCODED or kind in X8_ONLY
        assert kernel.piece.kind == quant_x8.REPACKED[kind][0]
        assert kernel.code == {"gguf:Q4_0": 5, "gguf:Q8_0": 6, "gguf:Q4_K": 7, "gguf:Q6_K": 8, "gguf:Q4_1": 13,
                               "gguf:Q5_0": 14, "gguf:Q5_1": 15, "gguf:Q5_K": 16, "gguf:IQ4_NL": 17,
                               "gguf:IQ4_XS": 18, "gguf:Q2_K": 19, "gguf:Q3_K": 20}[kind] | 64
        assert kernel.piece.tensors["blocks8"].numel() == -(-rows // 8) * 8 * blocks.shape[1]
        assert torch.equal(quant_x8.as_original(kernel.piece).tensors["blocks"], blocks)
        w = dequantize_piece(piece)
        assert torch.equal(dequantize_piece(kernel.piece), w)
        ids = torch.tensor([rows - 1, 0, 3, rows - 1])
        assert torch.equal(dequantize_piece(narrow_piece(kernel.piece, 0, ids)), w[ids])
        assert torch.equal(dequantize_piece(narrow_piece(kernel.piece, 0, 2, rows - 3)), w[2:rows - 1])
        for m in (1, 3, 4, 5, 8, 9, 20, 1100):  # (1100 rows of 256: x in chunks of 32 KiB)
            x = torch.randn(m, 256, generator=gen)
            got = kernel.apply(x).double()
            want = F.linear(int8_blocks(x).double(), w.double())
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["float", "int8"])
def test_an_embedding_lookup_decodes_the_references_rows(isa_level, kind, mode, monkeypatch):
    """omni_qrows (an embedding sharing the LM head's weight looks up through its kernel): the rows
    `dequantize_piece` gives, bit for bit, in each layout the kernel holds (the groups of 8 of the
    int8 mode included) and both dtypes; an id outside the table is an IndexError naming it."""
    from omniinfer.quantization.base import QuantizedWeight, Segment

    monkeypatch.setenv(ACT_ENV, mode)
    gen = torch.Generator().manual_seed(20 + KINDS.index(kind))
    rows, cols = 37, 512
    piece = piece_of(kind, torch.randn(rows, cols, generator=gen) * 0.05)
    kernel = CpuQuantKernel(piece)
    w = dequantize_piece(kernel.piece if kind in NEARLY and mode == "float" else piece)  # (its rewrite's)
    ids = torch.tensor([rows - 1, 0, 9, 8, 7, rows - 1, 16])
    for dtype in (torch.float32, torch.bfloat16):
        got = kernel.rows(ids, dtype)
        assert got.dtype == dtype and torch.equal(got, w[ids].to(dtype))
    table = QuantizedWeight((rows, cols), [Segment(0, kernel.piece, kernel)])
    assert torch.equal(table.rows_of(ids, torch.float32), w[ids])
    assert torch.equal(QuantizedWeight((rows, cols), [Segment(0, kernel.piece)]).rows_of(ids, torch.float32), w[ids])
    with pytest.raises(IndexError, match=rf"row {rows} of a .* table of {rows} rows: ids must be in \[0, {rows}\)"):
        kernel.rows(torch.tensor([3, rows]), torch.float32)
    assert kernel.rows(ids, torch.float16) is None  # (the reference's, then)


def test_the_prefetch_target_follows_the_variable_else_the_vendor(monkeypatch):
    """Where batch-1 products prefetch the weight (csrc/prefetch.h): OMNIINFER_CPU_PREFETCH, else
    L2 on Intel and AMD CPUs (measured faster there) and L1 elsewhere; a value it does not know is
    named."""
    from omniinfer.platforms import host
    from omniinfer_cpu.kernels import build

    monkeypatch.delenv(build.ENV_PREFETCH, raising=False)
    for vendor, target in (("GenuineIntel", "l2"), ("AuthenticAMD", "l2"), ("ARM", "l1"), ("", "l1")):
        monkeypatch.setattr(host, "cpu_info", lambda v=vendor: {"vendor": v} if v else {})
        assert build.prefetch_target()[0] == target, vendor
    monkeypatch.setenv(build.ENV_PREFETCH, "L1")
    assert build.prefetch_target() == ("l1", "OMNIINFER_CPU_PREFETCH=l1")
    monkeypatch.setenv(build.ENV_PREFETCH, "l3")
    with pytest.raises(ValueError, match=r"OMNIINFER_CPU_PREFETCH='l3': allowed values are l2 .* and l1"):
        build.prefetch_target()


@pytest.mark.parametrize("kind", ["gguf:Q4_0", "gguf:Q4_K", "gguf:Q8_0"])
def test_either_prefetch_target_gives_the_same_products(isa_level, kind, monkeypatch):
    """The prefetch hint moves no number: a batch-1 product (a weight long enough to prefetch
    ahead of) is bit for bit the same with the lines prefetched into L2 or into L1."""
    monkeypatch.setenv(ACT_ENV, "int8")
    gen = torch.Generator().manual_seed(11)
    kernel = CpuQuantKernel(piece_of(kind, torch.randn(256, 1024, generator=gen) * 0.05))
    x = torch.randn(1, 1024, generator=gen)
    try:
        assert isa_level.prefetch_to_l2(1) == 1
        into_l2 = kernel.apply(x)
        assert isa_level.prefetch_to_l2(0) == 0
        assert torch.equal(kernel.apply(x), into_l2)
    finally:  # (as loaded)
        isa_level.prefetch_to_l2(1 if isa_level.prefetch.startswith("L2") else 0)


# FP8 (e4m3) checkpoints' rows: every byte value but NaN's two, with each scale layout they come in
FP8_CASES = [((300, 512), (128, 128)), ((64, 256), None), ((130, 384), (128, 256)), ((40, 1024), (1, 128)),
             ((19, 256), (128, 512))]


def fp8_piece(gen, shape, block):
    from omniinfer.quantization.fp8 import piece_of

    rows, cols = shape
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    q = codes[torch.randint(0, codes.numel(), shape, generator=gen)].view(torch.float8_e4m3fn)
    if block is None:
        scale = torch.tensor(0.0123)
    else:
        scale = torch.rand(-(-rows // block[0]), -(-cols // block[1]), generator=gen) * 0.01 + 1e-4
    return piece_of(q, scale, block)


@pytest.mark.parametrize("shape,block", FP8_CASES, ids=[f"{s[0]}x{s[1]}-{b}" for s, b in FP8_CASES])
def test_fp8_rows_match_the_reference(isa_level, shape, block):
    """omni_qlinear's F8 rows (the file's e4m3 bytes decoded exactly in registers, a scale per 128
    columns) against the reference's dequantised weight (torch's own e4m3 conversion) in float64,
    at decode and prefill row counts; bfloat16 x of more than F8_PANEL_ROWS rows, where bfloat16
    hardware makes torch's matmul the faster, as the reference computes it (the weight rounded to bfloat16, torch's matmul); the embedding lookup bit for
    bit; the bytes held are the piece's (a scale per 128 columns of a row is the piece's own at
    block 128)."""
    from omniinfer_cpu.quant import fp8_prefill_rows

    gen = torch.Generator().manual_seed(shape[0])
    piece = fp8_piece(gen, shape, block)
    rows, cols = shape
    assert CpuQuantKernel.unavailable(piece.kind, piece.shape) is None
    kernel = CpuQuantKernel(piece)
    assert kernel.name == f"cpu ({isa_level.level.name}, float activations)"
    assert kernel.w.data_ptr() == piece.tensors["q"].data_ptr()
    assert (kernel.scale.data_ptr() == piece.tensors["scale"].data_ptr()) == (piece.kind == "fp8:b128")
    w = dequantize_piece(piece).double()
    for m in (1, 2, 3, 5, 8, 9, 33):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, cols + 8, generator=gen)[:, 4:4 + cols].to(dtype)  # strided rows
            got = kernel.apply(x)
            assert got.dtype == dtype and got.shape == (m, rows)
            if m > fp8_prefill_rows(dtype):
                torch.testing.assert_close(got, F.linear(x, w.to(dtype)))
                continue
            want = x.double() @ w.t()
            tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(got.double(), want if dtype == torch.float32 else want.to(dtype).double(),
                                       **tol)
    ids = torch.tensor([rows - 1, 0, 7, rows - 1])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(kernel.rows(ids, dtype), dequantize_piece(piece)[ids].to(dtype))


def test_what_the_fp8_kernel_leaves_to_the_reference(isa_level):
    assert CpuQuantKernel.unavailable("fp8:b128", (8, 320)) == "320 columns are not whole blocks of 128"
    assert CpuQuantKernel.unavailable("fp8", (8, 200)) == "200 columns are not whole blocks of 128"
    assert CpuQuantKernel.unavailable("fp8:b64", (8, 256)) is not None  # (not a kind it runs: no scale a 128)
    assert "fp8:b64" not in CpuQuantKernel.kinds
    assert CpuQuantKernel.unavailable("fp8:b256", (8, 512)) is None
