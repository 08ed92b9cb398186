"""The core's Triton fused-MoE kernel (a grouped GEMM over tokens sorted by expert) against the
torch reference, under Triton's interpreter on CPU (compiled on a GPU); its sort/align helper;
and the accelerator platforms' transform installing it."""

from __future__ import annotations

import pytest
import torch

from omniinfer.models.layers.moe import reference_moe, select_experts

pytest.importorskip("triton")
from omniinfer.kernels.triton.fused_moe import fused_moe, moe_align_block_size  # noqa: E402


def routed(tokens, experts, top_k, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.2).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, experts, generator=g), top_k, renormalize=False)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("block_m", [4, 16])
def test_align_groups_pairs_by_expert_in_padded_blocks(block_m):
    ids = torch.tensor([[3, 0], [0, 2], [3, 0], [1, 3]])
    sorted_ids, block_expert, num_padded = moe_align_block_size(ids, block_m, num_experts=5)
    flat = ids.flatten()
    used = sorted_ids[: int(num_padded)]
    assert int(num_padded) % block_m == 0 and len(sorted_ids) % block_m == 0
    real = used[used < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))  # every pair once
    assert flat[real.long()].tolist() == sorted(flat.tolist())  # grouped by expert, increasing
    for b in range(int(num_padded) // block_m):  # each block: one expert's pairs, then padding
        block = sorted_ids[b * block_m:(b + 1) * block_m]
        members = block[block < flat.numel()].long()
        assert len(members) > 0 and (flat[members] == block_expert[b]).all()
    assert (block_expert[int(num_padded) // block_m:] == 5).all()  # past the end: no expert


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 8, 2, 64, 32),  # decode: two experts read
    (5, 6, 3, 40, 24),  # widths that are not multiples of the tiles
    (70, 4, 2, 32, 16),  # 140 pairs: BLOCK_M 64
])
def test_fused_moe_matches_reference(dtype, tokens, experts, top_k, hidden, inter):
    x, w13, w2, weights, ids = routed(tokens, experts, top_k, hidden, inter, dtype)
    got = fused_moe(x, w13, w2, weights, ids)
    want = reference_moe(x.float(), w13.float(), w2.float(), weights, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # no further from the float32 sum than torch's own bfloat16 reference
        torch_bf16 = reference_moe(x, w13, w2, weights, ids).float()
        err, torch_err = (got.float() - want).abs(), (torch_bf16 - want).abs()
        assert err.mean() <= 1.5 * torch_err.mean() + 1e-4 and err.max() <= 3 * torch_err.max() + 1e-3


def test_decode_reads_only_the_routed_experts():
    x, w13, w2, weights, ids = routed(1, 8, 2, 64, 32, torch.float32, seed=4)
    want = reference_moe(x, w13, w2, weights, ids)
    unused = torch.ones(8, dtype=torch.bool)
    unused[ids.flatten()] = False
    w13[unused], w2[unused] = float("nan"), float("nan")
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-5)


def test_accelerator_transform_installs_it_where_triton_runs(monkeypatch):
    from omniinfer.models.layers import moe_triton
    from omniinfer.models.layers.moe import FusedMoE

    layer = FusedMoE(4, 2, 32, 16, renormalize=True)
    method = moe_triton.TritonModelTransform("cpu").moe_method(layer)  # interpreted here
    assert isinstance(method, moe_triton.TritonMoEMethod)
    monkeypatch.setattr("omniinfer.kernels.triton.unavailable_reasons", lambda device: ["no triton"])
    assert moe_triton.TritonModelTransform("cuda").moe_method(layer) is None


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_models_on_the_triton_method_match_transformers(name, checkpoint_dir, hf_greedy, monkeypatch):
    """Every MoE layer on fused_moe (interpreted), prefills and decodes: transformers' tokens."""
    from test_parity import check_parity, make_prompts

    from omniinfer.models.layers.moe import FusedMoE
    from omniinfer.models.layers.moe_triton import TritonMoEMethod
    from omniinfer_cpu.transform import CpuModelTransform

    monkeypatch.setattr(CpuModelTransform, "moe_method", lambda self, layer: TritonMoEMethod())
    llm = check_parity(checkpoint_dir(name), hf_greedy, make_prompts(300, [1, 9, 33]), max_tokens=8,
                       num_kv_blocks=64)
    model = llm.llm_engine.executor.worker.model_runner.model
    assert {m.moe_method.name for m in model.modules() if isinstance(m, FusedMoE)} == {"triton fused_moe"}
