"""The GGUF Triton kernel (kernels/triton/gguf_gemm.py) against the `gguf` package's own
dequantisation: interpreted on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 without an
accelerator), compiled where there is a GPU.

Blocks are random bytes with float16 scales of a sensible size (testing.kquant.random_blocks),
so every code, every 6-bit scale and minimum and every fifth or sixth bit pattern occurs.

* The decoder is checked bit for bit: multiplied by the identity in float32 (a tl.dot of
  one-hot rows, exact), the kernel gives back ``gguf.quants.dequantize``'s weights exactly
  (zeros but for their sign: the sums start from +0).
* The products (every dtype through the GEMV and the GEMM) are checked as
  test_triton_quant_kernels.py checks the n-bit ones: the GEMM and the reference (the weight
  dequantised to x's dtype, F.linear) multiply the same rounded operands with float32 sums,
  the GEMV the float32 weight unrounded; outputs agree to the output dtype's rounding of the
  largest output (2**-10 fp16, 2**-7 bf16) and to 1e-5 in float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniinfer.kernels import triton as triton_kernels
from omniinfer.quantization import gguf_blocks
from omniinfer.quantization.base import QuantPiece, ReferenceKernel, narrow_piece

pytest.importorskip("triton")
gguf = pytest.importorskip("gguf")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from test_triton_quant_kernels import close  # noqa: E402

from omniinfer.kernels.triton.gguf_gemm import KERNEL_TYPES, gguf_matmul  # noqa: E402
from omniinfer.kernels.triton.gguf_gemv import IQ4_POLY, iq4_value  # noqa: E402
from omniinfer.quantization.triton_kernel import GGUF_KINDS, TritonQuantKernel  # noqa: E402
from omniinfer.testing.kquant import random_blocks  # noqa: E402

INTERPRETED = triton_kernels.interpret_requested()
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
N = 72  # not a multiple of the 64-wide output tile


def blocks_of(name: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(random `name` blocks [n, row bytes], gguf.quants.dequantize's float32 weights [n, k])."""
    kind = gguf_blocks.BY_NAME[name]
    data = random_blocks(kind, n, k, np.random.default_rng(kind.code * 100 + seed))
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[name]).reshape(n, k)
    return torch.from_numpy(data), torch.from_numpy(want.astype(np.float32))


def run(x, blocks, name, bias=None):
    return gguf_matmul(x.to(DEVICE), blocks.to(DEVICE), name,
                       None if bias is None else bias.to(DEVICE)).cpu()


def test_the_kernel_and_the_gpu_plugins_name_the_same_types():
    from omniinfer.quantization.gguf_transcode import LATTICE_AS

    assert {f"gguf:{t}" for t in (*KERNEL_TYPES, *LATTICE_AS)} == set(GGUF_KINDS)
    assert set(KERNEL_TYPES) | set(LATTICE_AS) == {t.name for t in gguf_blocks.TYPES.values() if t.block > 1}
    assert all(target in KERNEL_TYPES for target in LATTICE_AS.values())


@pytest.mark.parametrize("name", KERNEL_TYPES)
def test_the_decoder_is_gguf_dequantize_bit_for_bit(name):
    blocks, want = blocks_of(name, 40, 512)
    got = run(torch.eye(512), blocks, name).T  # row i of the identity picks input i
    # equal floats: bit for bit but for the sign of zero (a sum from +0 of -0 * 1 is +0)
    assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("name", KERNEL_TYPES)
def test_the_dequantising_kernel_is_gguf_dequantize_rounded_once(name):
    """gguf_dequantize (prefill's weight, multiplied by torch): float32 bit for bit, and each
    16-bit dtype the float32 weight rounded once; K of 3 x 256 makes 24 runs (RUNS 8 divides
    them, 16 does not) and 72 outputs part of a 64-wide tile."""
    from omniinfer.kernels.triton.gguf_gemm import gguf_dequantize

    blocks, want = blocks_of(name, N, 768, seed=1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = gguf_dequantize(blocks.to(DEVICE), name, 768, dtype, runs=16).cpu()
        assert got.dtype == dtype and torch.equal(got, want.to(dtype)), dtype


@pytest.mark.parametrize("name", KERNEL_TYPES)
@pytest.mark.parametrize("dtype,m", [(torch.float16, 1), (torch.bfloat16, 8), (torch.float32, 1),
                                     (torch.float16, 17), (torch.bfloat16, 17), (torch.float32, 17)])
def test_products_match_the_reference(name, dtype, m):
    """Each dtype through the split-K GEMV (1-8 rows) and the tl.dot GEMM."""
    blocks, want = blocks_of(name, N, 512)
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).to(dtype)
    close(run(x, blocks, name), torch.nn.functional.linear(x, want.to(dtype)))


@pytest.mark.parametrize("m", [3, 40])
def test_bias_and_batch_dims(m):
    blocks, want = blocks_of("Q4_K", N, 256)
    x = torch.randn(1, m, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = run(x, blocks, "Q4_K", bias)
    assert got.shape == (1, m, N)
    close(got[0], (torch.nn.functional.linear(x[0].float(), want.to(torch.bfloat16).float())
                   + bias.float()).to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["gguf:Q6_K", "gguf:Q5_0"])
def test_the_gpu_plugins_kernel_runs_tensor_parallel_pieces_as_the_reference(kind):
    """The pieces a rank holds: some rows (column-parallel), some blocks of columns
    (row-parallel); the kernel keeps the file's bytes (no repacked copy)."""
    blocks, _ = blocks_of(kind.split(":")[1], 96, 768)
    piece = QuantPiece(kind, (96, 768), {"blocks": blocks})
    for part in (narrow_piece(piece, 0, 16, 40), narrow_piece(piece, 1, 256, 512)):
        kernel = TritonQuantKernel(part)
        assert kernel.piece is part and kernel.weight.data_ptr() == part.tensors["blocks"].data_ptr()
        for rows in (1, 20):
            x = torch.randn(rows, part.shape[1], generator=torch.Generator().manual_seed(rows))
            close(kernel.apply(x), ReferenceKernel(part).apply(x))


def test_bad_shapes_are_named():
    blocks, _ = blocks_of("Q4_0", 8, 64)
    with pytest.raises(ValueError, match=r"x has K=48 inputs, not a whole number of Q4_0 blocks of 32"):
        gguf_matmul(torch.randn(2, 48), blocks, "Q4_0")
    with pytest.raises(ValueError, match=r"blocks must be uint8 \[N, 72\] with contiguous rows for K=128 "
                                         r"of Q4_0, got torch.uint8 \(8, 36\)"):
        gguf_matmul(torch.randn(2, 128), blocks, "Q4_0")
    with pytest.raises(ValueError, match=r"type_name='TQ2_0': the GGUF kernel decodes Q4_0, "):
        gguf_matmul(torch.randn(2, 64), blocks, "TQ2_0")
    assert gguf_matmul(torch.randn(0, 64), blocks, "Q4_0").shape == (0, 8)
    bad = dict(BLOCK_M=1, BLOCK_N=64, BLOCK_K=64, split_k=1, k_per_split=64, USE_DOT=False)
    with pytest.raises(ValueError, match=r"the GGUF kernel decodes 32-weight runs \(BLOCK_K 32"):
        gguf_matmul(torch.randn(1, 64).to(DEVICE), blocks.to(DEVICE), "Q4_0", tiles=bad)
    from omniinfer.kernels.triton.gguf_gemm import gguf_dequantize

    assert gguf_dequantize(blocks[:0], "Q4_0", 64, torch.float16).shape == (0, 64)


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"])
def test_the_lattice_types_run_as_their_rewrite(name):
    """The GPU plugins' kernel for llama.cpp's lattice types: rewritten at load (gguf_transcode:
    IQ3 and IQ1 exactly as Q6_K, IQ2 as Q8_0 within half a step), then the kernel's own decode;
    against the reference on the file's blocks (gguf.quants.dequantize's weights)."""
    from omniinfer.quantization.gguf_transcode import LATTICE_AS

    blocks, want = blocks_of(name, N, 512)
    kernel = TritonQuantKernel(QuantPiece(f"gguf:{name}", (N, 512), {"blocks": blocks}))
    assert kernel.piece.kind == f"gguf:{LATTICE_AS[name]}"
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    got = kernel.apply(x.to(DEVICE)).cpu()
    if LATTICE_AS[name] == "Q6_K":
        close(got, torch.nn.functional.linear(x, want))
    else:  # (each weight within half a step, 1/254 of its 32's largest: the sums within that of |x| . |w|)
        bound = torch.nn.functional.linear(x.abs(), want.abs()) / 254 + 1e-4
        assert ((got - torch.nn.functional.linear(x, want)).abs() <= bound).all()


CLASSIC = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL")
KQUANT = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")


@triton.jit
def _iq4_values(q_ptr, out_ptr):
    i = tl.arange(0, 16)
    tl.store(out_ptr + i, iq4_value(tl.load(q_ptr + i)))


def test_the_iq4_polynomial_gives_the_table_at_every_code():
    """gguf_gemv.iq4_value, as a kernel computes it (explicit float32 FMAs, the last one rounding
    to an integer), is IQ4_VALUES at each of the 16 codes; and its polynomial is within 0.44 of
    them in exact arithmetic, so the float32 steps (error ~1e-5) cannot round across a half."""
    q = torch.arange(16, dtype=torch.float32, device=DEVICE)
    out = torch.empty(16, dtype=torch.float32, device=DEVICE)
    _iq4_values[(1,)](q, out)
    assert out.cpu().tolist() == [float(v) for v in gguf_blocks.IQ4_VALUES]
    poly = [-127 + sum(c * j ** (e + 1) for e, c in enumerate(IQ4_POLY)) for j in range(16)]
    assert max(abs(p - v) for p, v in zip(poly, gguf_blocks.IQ4_VALUES)) <= 0.44


@pytest.mark.parametrize("step", [3, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", CLASSIC)
def test_the_one_row_gemv_of_the_classic_types_decodes_weights_bit_for_bit(name, step):
    """The one-row GEMV of the classic types and IQ4_NL (kernels/triton/gguf_gemv.py: halfword loads,
    codes made exact floats in place, d and the minimum applied once a block) times one-hot
    rows: column i of gguf.quants.dequantize's weights, exactly, for every third input (the slow
    tier: every input): each of the 3 blocks and each of a block's 32 positions. K = 96 is 3
    blocks, an odd number for the 2-block steps (the masked tail); 72 outputs, a ragged output
    tile."""
    inputs = range(0, 96, step)
    assert {i // 32 for i in inputs} == {0, 1, 2} and {i % 32 for i in inputs} == set(range(32))
    one_hot_columns_are_exact(name, 96, inputs)


def one_hot_columns_are_exact(name: str, k: int, inputs):
    """Each one-hot row e_i (i in `inputs`) through the one-row GEMV gives column i of
    gguf.quants.dequantize's weights [N, k] exactly."""
    blocks, want = blocks_of(name, N, k, seed=2)
    for i in inputs:
        x = torch.zeros(1, k)
        x[0, i] = 1.0
        assert torch.equal(run(x, blocks, name)[0], want[:, i]), i


@pytest.mark.parametrize("name", CLASSIC)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_one_row_gemv_of_the_classic_types_without_masks(name, dtype):
    """N a multiple of the output tile and every split whole 2-block steps: the GEMV's loads
    are unmasked (EVEN); the products still match the reference."""
    from omniinfer.kernels.triton.gguf_gemm import CLASSIC_UNROLL, gguf_tiles
    from omniinfer.kernels.triton.gguf_gemv import classic_gemv_even

    blocks, want = blocks_of(name, 128, 512, seed=3)
    cfg = gguf_tiles(1, 128, 512, 2, name)
    assert classic_gemv_even(128, 512, cfg["BLOCK_N"], cfg["k_per_split"], CLASSIC_UNROLL)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(4)).to(dtype)
    close(run(x, blocks, name), torch.nn.functional.linear(x, want.to(dtype)))


@pytest.mark.parametrize("step", [13, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", KQUANT)
def test_the_one_row_gemv_of_the_k_quants_decodes_weights_bit_for_bit(name, step):
    """The one-row GEMV of Q2_K-Q6_K and IQ4_XS (kernels/triton/gguf_kgemv.py: word or halfword
    loads, codes made floats in place, each sub-block's scale (and minimum) once an output)
    times one-hot rows: column i of gguf.quants.dequantize's weights, exactly, for every 13th
    input of two blocks (the slow tier: every input); 72 outputs, a ragged (masked) output tile.
    An interpreted launch is ~0.15 s, so the default tier takes 40 of the 512 columns: each of
    the 32 sixteen-wide sub-blocks, and each of the 32 positions of a 32-code chunk (every byte,
    nibble and word position of the codes)."""
    inputs = range(0, 512, step)
    assert {i // 16 for i in inputs} == set(range(32)) and {i % 32 for i in inputs} == set(range(32))
    one_hot_columns_are_exact(name, 512, inputs)


@pytest.mark.parametrize("name", KQUANT)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_one_row_gemv_of_the_k_quants_unmasked_and_split(name, dtype):
    """N whole output tiles (no masks) and K split in whole blocks: the products match the
    reference."""
    from omniinfer.kernels.triton.gguf_gemm import gguf_tiles

    cfg = gguf_tiles(1, 128, 1024, 2, name)
    assert 128 % cfg["BLOCK_N"] == 0 and cfg["split_k"] > 1 and cfg["k_per_split"] % 256 == 0
    blocks, want = blocks_of(name, 128, 1024, seed=3)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(4)).to(dtype)
    close(run(x, blocks, name), torch.nn.functional.linear(x, want.to(dtype)))


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q4_0", "IQ4_XS"])
def test_blocks_at_an_odd_address_take_the_byte_decoder(name, monkeypatch):
    """The one-row GEMVs' word (Q4_K) and halfword (Q6_K, Q4_0) loads need aligned blocks;
    blocks at an odd address (a view into a larger buffer) take the byte decoder, with the
    same products."""
    from omniinfer.kernels.triton import gguf_gemm

    paths = []
    launch = gguf_gemm.launch_weight_only
    monkeypatch.setattr(gguf_gemm, "launch_weight_only",
                        lambda *a, **kw: paths.append(kw["ONE_ROW"]) or launch(*a, **kw))
    blocks, want = blocks_of(name, N, 512, seed=5)
    buffer = torch.zeros(blocks.numel() + 1, dtype=torch.uint8, device=DEVICE)
    buffer[1:] = blocks.reshape(-1).to(DEVICE)
    odd = buffer[1:].view(blocks.shape)
    assert odd.data_ptr() % 4 != 0
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(6))
    close(gguf_matmul(x.to(DEVICE), odd, name).cpu(), torch.nn.functional.linear(x, want))
    gguf_matmul(x.to(DEVICE), blocks.to(DEVICE), name)  # aligned: the one-row GEMV
    assert paths == [0, {"Q6_K": 3, "Q4_K": 2, "Q4_0": 1, "IQ4_XS": 6}[name]]
