"""omni_moe (the CPU plugin's mixture-of-experts kernel) against the core's torch reference at
every ISA level this CPU runs; a decode step reads only its routed experts' weights."""

from __future__ import annotations

import pytest
import torch

from omniinfer.models.layers.moe import reference_moe, select_experts
from omniinfer_cpu.moe import CpuMoEMethod


class Layer:  # what a method reads of a FusedMoE layer
    def __init__(self, w13, w2):
        self.w13_weight, self.w2_weight = w13, w2


def routed(tokens, experts, top_k, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    logits = torch.randn(tokens, experts, generator=g).to(dtype)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, Layer(w13, w2), weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("experts,top_k,hidden,inter", [(8, 2, 64, 32), (4, 1, 33, 7), (16, 4, 256, 96)])
def test_moe_kernel_matches_reference(isa_level, dtype, tokens, experts, top_k, hidden, inter):
    x, layer, weights, ids = routed(tokens, experts, top_k, hidden, inter, dtype)
    got = CpuMoEMethod(isa_level).apply(layer, x, weights, ids)
    want = reference_moe(x.float(), layer.w13_weight.float(), layer.w2_weight.float(), weights, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # no further from the float32 sum than torch's own bfloat16 reference is
        torch_bf16 = reference_moe(x, layer.w13_weight, layer.w2_weight, weights, ids).float()
        err, torch_err = (got.float() - want).abs(), (torch_bf16 - want).abs()
        assert err.mean() <= 1.5 * torch_err.mean() + 1e-4 and err.max() <= 3 * torch_err.max() + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_only_the_routed_experts(isa_level, dtype):
    """Every expert not routed to holds NaN: a kernel that touched one would return NaN."""
    x, layer, weights, ids = routed(1, 16, 2, 128, 64, dtype, seed=3)
    want = reference_moe(x, layer.w13_weight, layer.w2_weight, weights, ids)
    unused = torch.ones(16, dtype=torch.bool)
    unused[ids.flatten()] = False
    layer.w13_weight[unused] = float("nan")
    layer.w2_weight[unused] = float("nan")
    got = CpuMoEMethod(isa_level).apply(layer, x, weights, ids)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(),
                               **({} if dtype == torch.float32 else dict(rtol=0.1, atol=0.1)))


def test_big_batches_run_the_reference_and_bad_ids_are_refused(isa_level):
    x, layer, weights, ids = routed(40, 8, 2, 64, 32, torch.float32)
    method = CpuMoEMethod(isa_level, max_rows=16)
    torch.testing.assert_close(method.apply(layer, x, weights, ids),
                               reference_moe(x, layer.w13_weight, layer.w2_weight, weights, ids))
    with pytest.raises(ValueError, match="outside"):
        method.apply(layer, x[:1], weights[:1], torch.tensor([[0, 8]]))


def test_threads_split_each_expert(isa_level):
    """Two threads share each expert's rows (gate/up by ranges of I, down by ranges of H)."""
    x, layer, weights, ids = routed(3, 8, 2, 256, 160, torch.float32, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = CpuMoEMethod(isa_level).apply(layer, x, weights, ids)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, reference_moe(x, layer.w13_weight, layer.w2_weight, weights, ids),
                               rtol=1e-5, atol=1e-5)
