"""AMX's bfloat16 tiles for quantised products of many rows (quant_amx.c): every GGUF type in groups
of 8 rows against the reference's weights and x both rounded to bfloat16, multiplied in float64
(the tiles sum float32 products of bfloat16 values: exact up to the order of float32 sums); below
the row counts where the tiles pay, the int8 path's very numbers; OMNIINFER_CPU_AMX=0 keeps every
row count on the int8 path; and a GGUF model's prefills on the tiles follow transformers. Skipped
(saying what is missing) on CPUs without AMX-BF16: the tile code never runs there."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

gguf = pytest.importorskip("gguf")

from test_quant_kernels import GGUF_KINDS, int8_blocks, piece_of  # noqa: E402

from omniinfer.quantization.base import dequantize_piece  # noqa: E402
from omniinfer_cpu.kernels import build, isa  # noqa: E402
from omniinfer_cpu.quant import ACT_ENV, CpuQuantKernel  # noqa: E402
from omniinfer_cpu.report import AMX_ROWS, AMX_ROWS_I8  # noqa: E402

AMX_KINDS = GGUF_KINDS + ["int8"]  # (int8: quantization="int8" and W8A8 rows, a scale each)


def amx_kernels():
    """The avx512_bf16 kernels with the tiles on, or a skip that says what this machine lacks."""
    missing = isa.missing_flags(isa.BY_NAME["avx512_bf16"]) + sorted({"amx_tile", "amx_bf16"} - isa.cpu_flags())
    if missing:
        pytest.skip(f"AMX tiles need avx512_bf16 kernels and AMX-BF16: this CPU lacks {', '.join(missing)}")
    kernels = build.load_level("avx512_bf16")
    state = kernels.set_amx(True)
    if state != "on":
        pytest.skip(f"AMX tiles unavailable: {state}")
    return kernels


@pytest.fixture
def amx(monkeypatch):
    monkeypatch.setenv(isa.ENV_ISA, "avx512_bf16")
    monkeypatch.setenv(ACT_ENV, "int8")
    monkeypatch.delenv(build.ENV_AMX, raising=False)
    build.reset()
    kernels = amx_kernels()
    assert build.load() is not None and build.load().amx == "on"
    yield kernels
    monkeypatch.undo()
    build.reset()


def bf16_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.bfloat16().double(), w.bfloat16().double())


@pytest.mark.parametrize("kind", AMX_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_multiply_the_bfloat16_rounded_numbers(amx, kind, dtype):
    """Row counts around the threshold, weights of 8, 37 and 70 rows (a last group padded or
    absent, a last panel of 32 part-filled), x with strided rows; bfloat16 x is multiplied as it
    is. Below the threshold the int8 path's numbers (x in int8 blocks of 32)."""
    gen = torch.Generator().manual_seed(AMX_KINDS.index(kind))
    threshold = AMX_ROWS_I8 if kind == "int8" else AMX_ROWS
    for rows, cols in ((8, 256), (37, 512), (70, 256)):
        weight = torch.randn(rows, cols, generator=gen) * 0.05
        kernel = CpuQuantKernel(piece_of(kind, weight))
        assert kernel.name.startswith("cpu (avx512_bf16 + AMX tiles for prefills, int8 activations"), kernel.name
        w = dequantize_piece(kernel.piece).float()
        for m in (threshold - 1, threshold, threshold + 1, threshold + 33):
            x = torch.randn(m, cols + 8, generator=gen)[:, 4:4 + cols].to(dtype)
            x[0, :32] *= 50  # (a block far larger than the rest: the int8 path's own scale, the tiles' none)
            got = kernel.apply(x).double()
            assert got.shape == (m, rows)
            tiles = bf16_reference(x, w)
            int8 = F.linear(int8_blocks(x).double(), w.double())  # (int8 rows too: row dots to I8_DOT_ROWS)
            want = tiles if m >= threshold else int8
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
                # and it is that rounding that was multiplied: the other path's is further away
                other = int8 if m >= threshold else tiles
                assert (got - want).abs().max() < 0.2 * (other - want).abs().max(), (kind, m)
            else:
                big = max(1.0, float(want.abs().max()))
                torch.testing.assert_close(got, want.bfloat16().double(), atol=2e-2 * big, rtol=1e-2)


@pytest.mark.parametrize("kind", ["gguf:Q4_K", "gguf:Q8_0", "int8"])
def test_a_thread_runs_x_over_spans_of_panels(amx, kind):
    """K = 8192: a decoded panel of 32 rows is 512 KB, so a span (AMX_SPAN_BYTES, 1 MB) holds two.
    200 rows are 7 panels, the last part-filled: with two threads 4 + 3, spans of 2 + 2 and 2 + 1.
    145 rows of x are five blocks of 32, the last part-filled, 2.6 MB in bfloat16: enough for spans
    (AMX_SPAN_MIN_X, 2 MB). Every output where it belongs."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 8192, generator=gen) * 0.05
    kernel = CpuQuantKernel(piece_of(kind, weight))
    w = dequantize_piece(kernel.piece).float()
    x = torch.randn(145, 8192, generator=gen)
    torch.testing.assert_close(kernel.apply(x).double(), bf16_reference(x, w), atol=1e-4, rtol=1e-5)


def test_the_switch_keeps_every_row_count_on_the_int8_path(amx, monkeypatch):
    weight = torch.randn(37, 512, generator=torch.Generator().manual_seed(1)) * 0.05
    piece = piece_of("gguf:Q4_0", weight)
    x = torch.randn(100, 512, generator=torch.Generator().manual_seed(2))
    on = CpuQuantKernel(piece).apply(x)
    monkeypatch.setenv(build.ENV_AMX, "0")
    build.reset()
    off_kernels = build.load()
    assert off_kernels.amx == f"off ({build.ENV_AMX}=0)"
    kernel = CpuQuantKernel(piece_of("gguf:Q4_0", weight))
    assert "AMX" not in kernel.name
    off = kernel.apply(x).double()
    torch.testing.assert_close(off, F.linear(int8_blocks(x).double(), dequantize_piece(kernel.piece).double()),
                               atol=2e-5, rtol=1e-5)
    assert not torch.equal(off, on.double())
    from omniinfer_cpu.report import kernel_report

    family = kernel_report()["cpu_kernel_families"]["AMX quantised prefills"]
    assert family == {"active": False, "why": f"off ({build.ENV_AMX}=0): products of many rows stay on the int8 path"}


def test_levels_without_the_tile_code_say_so():
    """Below avx512_bf16 the library has no AMX code: asking for it says so, nothing runs."""
    below = [lv for lv in isa.runnable_levels() if lv.name != "avx512_bf16"]
    if not below:
        pytest.skip("this CPU runs no CPU kernel level below avx512_bf16")
    kernels = build.load_level(below[0].name)
    for on in (True, False):
        assert kernels.set_amx(on) == "this level's library has no AMX code (avx512_bf16's has)"


def test_a_gguf_models_prefills_on_the_tiles_follow_transformers(amx, tmp_path):
    """Two prompts of 70 and 45 tokens prefilled together (115 rows a product: the tiles), then
    decoded together (2 rows: the int8 path): greedy tokens equal transformers' (dequantising the
    same file) up to a near-tie, as the int8 path's are (tests/test_quantization.py)."""
    from omniinfer import LLM, SamplingParams
    from omniinfer.benchmarks.gguf_export import export
    from omniinfer.testing.greedy import agreed_steps, hf_greedy, kernel_names
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(str(tmp_path / "llama"), "llama", hidden_size=256, intermediate_size=512,
                                 vocab_size=1000, seed=3)
    path = export(ckpt, str(tmp_path / "llama-q4_k_m.gguf"), "q4_k_m")
    prompts = [list(range(40, 110)), list(range(300, 345))]
    llm = LLM(path, num_kv_blocks=64, max_num_batched_tokens=256, max_num_seqs=4)
    try:
        names = kernel_names(llm)
        assert names and all(n.startswith("cpu (avx512_bf16 + AMX tiles for prefills,") for n in names), names
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        [(_, steps)] = hf_greedy(os.path.dirname(path), [prompt], 8, os.path.basename(path))
        agreed_steps(out.outputs[0].token_ids, steps)


@pytest.mark.parametrize("kinds", [("gguf:Q4_K", "gguf:Q6_K"), ("gguf:Q8_0", "gguf:Q4_0")])
def test_a_moe_chunks_experts_with_enough_tokens_take_the_tiles(amx, kinds):
    """omni_qmoe_tokens with the tiles on: an expert given AMX_ROWS tokens or more multiplies them
    on the tiles, the rest on the int8 groups, as the loop (each expert's tokens through its
    CpuQuantKernel) does: experts 0 and 1 get 40 and 24 tokens, 2-5 ten each; tokens 40-51 see
    none of the tiled experts."""
    from test_quant_moe import Layer

    layer = Layer(kinds, seed=5)
    method = layer.moe_method
    step = method.step
    gen = torch.Generator().manual_seed(3)
    tokens = 52
    ids = torch.tensor([[0, 1] if t < 24 else [0, 2 + t % 4] if t < 40 else [2 + t % 4, 2 + (t + 1) % 4]
                        for t in range(tokens)])
    counts = torch.bincount(ids.flatten(), minlength=6)
    assert counts[0] >= AMX_ROWS and counts[1] >= AMX_ROWS and (counts[2:] < AMX_ROWS).all(), counts
    x = torch.randn(tokens, 256, generator=gen)
    weights = torch.rand(tokens, 2, generator=gen)
    got = step(x, weights, ids)
    method.step = None
    tiles = method.apply(layer, x, weights, ids)
    amx.set_amx(False)
    int8 = method.apply(layer, x, weights, ids)
    amx.set_amx(True)
    method.step = step
    torch.testing.assert_close(got, tiles, rtol=1e-5, atol=1e-4)
    # the tiled experts' tokens are where the two roundings differ; the rest are the int8 path's
    tiled = (ids == 0).any(1) | (ids == 1).any(1)
    assert (got[tiled] - tiles[tiled]).abs().max() < 0.2 * (int8[tiled] - tiles[tiled]).abs().max()
    torch.testing.assert_close(got[~tiled], int8[~tiled], rtol=1e-5, atol=1e-4)
