"""omni_qmoe, the CPU plugin's one-token step for quantised experts (CpuExpertsStep), at every ISA
level this CPU runs: the sum QuantMoEMethod's loop computes expert by expert through the same
kernels (routed_sum: the torch SiLU-and-multiply and weighted sum between the products)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from test_quant_kernels import piece_of  # noqa: E402

from omniinfer.quantization.base import QuantizedWeight, QuantLinearMethod, Segment  # noqa: E402
from omniinfer.quantization.experts import ExpertLinear, QuantExperts, QuantMoEMethod  # noqa: E402
from omniinfer_cpu.moe import CpuExpertsStep  # noqa: E402
from omniinfer_cpu.quant import ACT_ENV, CpuQuantKernel  # noqa: E402

E, H, INTER = 6, 256, 256  # (INTER of whole 256-blocks: the K-quants' down projections)


class Layer:
    def __init__(self, kinds: tuple[str, str], seed: int):
        gen = torch.Generator().manual_seed(seed)

        def expert(kind, rows, cols):
            piece = piece_of(kind, torch.randn(rows, cols, generator=gen) * 0.1)
            return ExpertLinear(QuantizedWeight(piece.shape, [Segment(0, piece)]))

        self.num_experts = E
        self.qexperts = QuantExperts([expert(kinds[0], 2 * INTER, H) for _ in range(E)],
                                     [expert(kinds[1], H, INTER) for _ in range(E)])
        self.moe_method = QuantMoEMethod(QuantLinearMethod("cpu", [CpuQuantKernel]))
        self.moe_method.process_weights_after_loading(self)


@pytest.mark.parametrize("mode", ["int8", "float"])
@pytest.mark.parametrize("kinds", [("gguf:Q4_K", "gguf:Q6_K"), ("gguf:Q8_0", "gguf:Q4_0"),
                                   ("gguf:IQ4_XS", "gguf:Q5_K")])
def test_the_step_is_the_loops_sum(isa_level, kinds, mode, monkeypatch):
    monkeypatch.setenv(ACT_ENV, mode)
    if mode == "float" and "gguf:IQ4_XS" in kinds:
        kinds = ("gguf:Q5_0", kinds[1])  # (IQ4_XS takes its rewrite with float activations)
    layer = Layer(kinds, seed=len(kinds[0]))
    method = layer.moe_method
    assert isinstance(method.step, CpuExpertsStep)
    gen = torch.Generator().manual_seed(1)
    for ids in ([[4, 1]], [[0, 5, 2]], [[3]], [[5, 4, 3, 2, 1, 0]]):
        x = torch.randn(1, H, generator=gen)
        ids = torch.tensor(ids)
        weights = torch.rand(ids.shape, generator=gen)
        step = method.apply(layer, x, weights, ids)
        method.step = None
        loop = method.apply(layer, x, weights, ids)
        method.step = CpuExpertsStep.of(*([e.quant_kernels[0][1] for e in side]
                                          for side in (layer.qexperts.w13, layer.qexperts.w2)))
        torch.testing.assert_close(step, loop, rtol=1e-5, atol=1e-5)


def test_the_step_refuses_what_it_does_not_take(isa_level, monkeypatch):
    monkeypatch.setenv(ACT_ENV, "int8")
    layer = Layer(("gguf:Q8_0", "gguf:Q8_0"), seed=3)
    step = layer.moe_method.step
    x = torch.randn(1, H)
    assert step(x.to(torch.bfloat16), torch.rand(1, 2), torch.tensor([[1, 2]])) is None  # (the loop takes it)
    with pytest.raises(RuntimeError, match=r"omni_qmoe failed \(-1\) for experts \[\[1, 6\]\] of 6"):
        step(x, torch.rand(1, 2), torch.tensor([[1, 6]]))


@pytest.mark.parametrize("kinds", [("gguf:Q4_K", "gguf:Q6_K"), ("gguf:Q8_0", "gguf:Q4_0"),
                                   ("gguf:IQ4_XS", "gguf:Q2_K")])
def test_a_chunk_of_tokens_in_one_call_is_the_loops_sum(isa_level, kinds, monkeypatch):
    """omni_qmoe_tokens (several tokens: a prefill chunk) against the loop, which multiplies each
    expert's tokens through the same kernels: up to the order of float32 sums."""
    monkeypatch.setenv(ACT_ENV, "int8")
    layer = Layer(kinds, seed=7)
    method = layer.moe_method
    step = method.step
    gen = torch.Generator().manual_seed(2)
    for tokens, k in ((2, 2), (9, 3), (300, 2)):  # (300: past one chunk of 256 tokens)
        x = torch.randn(tokens, H, generator=gen)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
        weights = torch.rand(tokens, k, generator=gen)
        got = step(x, weights, ids)
        assert got is not None
        method.step = None
        want = method.apply(layer, x, weights, ids)
        method.step = step
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_float_activations_leave_a_chunk_to_the_loop(isa_level, monkeypatch):
    monkeypatch.setenv(ACT_ENV, "float")
    layer = Layer(("gguf:Q8_0", "gguf:Q4_0"), seed=3)
    assert layer.moe_method.step(torch.randn(3, H), torch.rand(3, 2), torch.tensor([[1, 2]] * 3)) is None
