"""Mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers on tiny random
checkpoints (float32, initializer_range 0.1): greedy tokens through chunked prefill, prefix
caching and preemption, log-probabilities, tensor parallelism; the router and the experts' sum
against transformers' own modules; config fields that change the model."""

from __future__ import annotations

import random

import pytest
import torch
from test_distributed import STRESS, STRESS_PROMPTS, generate, tokens
from test_parity import check_parity, make_prompts

from omniinfer import LLM, SamplingParams
from omniinfer.models.layers.moe import FusedMoE, reference_moe, select_experts

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("kernels", ["1", "0"])
def test_greedy_matches_transformers(name, kernels, checkpoint_dir, hf_greedy, monkeypatch):
    """With the CPU plugin's compiled MoE kernel (decode steps) and without (the torch reference)."""
    from omniinfer_cpu.kernels import build

    monkeypatch.setenv("OMNIINFER_CPU_KERNELS", kernels)
    build.reset()
    try:
        llm = check_parity(checkpoint_dir(name), hf_greedy, make_prompts(300), num_kv_blocks=128)
    finally:
        monkeypatch.undo()
        build.reset()
    model = llm.llm_engine.executor.worker.model_runner.model
    methods = {m.moe_method.name for m in model.modules() if isinstance(m, FusedMoE)}
    assert methods == ({"omni_moe"} if kernels == "1" and build.load() is not None else {"torch reference"})


@pytest.mark.parametrize("name", [*FAMILIES, "mixtral_window"])
def test_chunked_prefill_prefix_caching_and_preemption(name, checkpoint_dir, hf_greedy):
    path = checkpoint_dir(name)
    rng = random.Random(2)
    prefix = [rng.randrange(3, 300) for _ in range(19)]
    prompts = make_prompts(300, [5, 30, 17, 9]) + [prefix + p for p in make_prompts(300, [3, 11, 8])]
    llm = check_parity(path, hf_greedy, prompts, block_size=8, num_kv_blocks=24,
                       enable_chunked_prefill=True, max_num_batched_tokens=12, max_num_seqs=6,
                       enable_prefix_caching=True, preemption_mode="swap", swap_space=0.01)
    stats = llm.llm_engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_logprobs_within_1e4(name, checkpoint_dir, hf_logprobs):
    path = checkpoint_dir(name)
    llm = LLM(path, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    prompt = make_prompts(300, [21])[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    ref = hf_logprobs(path, prompt + completion.token_ids)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + i]
        top = torch.topk(row, 3)
        assert int(top.indices[0]) == token
        for value, tid in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[tid].logprob - value) < 1e-4
    for j in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[j][prompt[j]].logprob - ref[j - 1][prompt[j]].item()) < 1e-4


@pytest.mark.parametrize("name", FAMILIES)
def test_tensor_parallel_matches_transformers(name, checkpoint_dir, hf_greedy):
    """TP=2 (each expert's intermediate dimension split, one all-reduce a layer) with chunked
    prefill and recompute preemption: transformers' tokens."""
    path = checkpoint_dir(name)
    outs, stats, _ = generate(path, STRESS_PROMPTS, tensor_parallel_size=2, **STRESS)
    assert stats["num_preemptions"] > 0
    assert tokens(outs) == [[hf_greedy(path, p, 16)] for p in STRESS_PROMPTS]


def test_pipeline_parallel_matches_transformers(checkpoint_dir, hf_greedy):
    """PP=2 on Qwen2-MoE: a sparse, a dense (mlp_only_layers) and a sparse layer split in two."""
    path = checkpoint_dir("qwen2_moe")
    outs, _, _ = generate(path, STRESS_PROMPTS, pipeline_parallel_size=2, **STRESS)
    assert tokens(outs) == [[hf_greedy(path, p, 16)] for p in STRESS_PROMPTS]


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_runs_and_tracks_float32(name, checkpoint_dir, hf_greedy):
    path = checkpoint_dir(name)
    llm = LLM(path, dtype="bfloat16", num_kv_blocks=32)
    prompt = make_prompts(300, [12])[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6,
                                                                     ignore_eos=True), use_tqdm=False)
    got = out[0].outputs[0].token_ids
    assert len(got) == 6 and got[:1] == hf_greedy(path, prompt, 24)[:1]


# ---- the pieces against transformers' modules --------------------------------------------------

def _hf_block(arch: str, **kw):
    import transformers

    settings = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                    num_key_value_heads=2, initializer_range=0.1)
    if arch == "mixtral":
        config = transformers.MixtralConfig(num_local_experts=6, num_experts_per_tok=2, **settings, **kw)
        block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    else:
        config = transformers.Qwen2MoeConfig(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                             shared_expert_intermediate_size=40, **settings, **kw)
        block = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock(config)
    torch.manual_seed(0)
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    return block.eval()


@pytest.mark.parametrize("arch,kw,renormalize", [("mixtral", {}, True),
                                                 ("qwen2_moe", dict(norm_topk_prob=False), False),
                                                 ("qwen2_moe", dict(norm_topk_prob=True), True)])
def test_routing_and_experts_match_transformers(arch, kw, renormalize):
    block = _hf_block(arch, **kw)
    x = torch.randn(1, 11, 32)
    with torch.no_grad():
        want = block(x)[0]
        logits = block.gate(x.view(-1, 32))[0]
        topk_weights, topk_ids = select_experts(logits, block.gate.top_k, renormalize)
        got = reference_moe(x[0], block.experts.gate_up_proj, block.experts.down_proj, topk_weights, topk_ids)
        if arch == "qwen2_moe":
            shared = block.shared_expert(x[0])
            got = got + torch.sigmoid(block.shared_expert_gate(x[0])) * shared
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_qwen2_moe_dense_layers_follow_mlp_only_layers_and_sparse_step(checkpoint_dir, tmp_path):
    from omniinfer.checkpoint_config import load_model_config
    from omniinfer.models.moe_decoder import sparse_layers

    cfg = load_model_config(checkpoint_dir("qwen2_moe"), tokenizer=None, dtype="auto", max_model_len=None,
                            seed=0).hf_config
    assert sparse_layers(cfg, 8) == {0, 2}
    assert sparse_layers(dict(cfg, decoder_sparse_step=2, mlp_only_layers=[]), 8) == {1}
    assert sparse_layers(cfg, 0) == set()
    with pytest.raises(ValueError, match="decoder_sparse_step=0 "):
        sparse_layers(dict(cfg, decoder_sparse_step=0), 8)


@pytest.mark.parametrize("changes,words", [
    (dict(num_experts_per_tok=9), ["num_experts_per_tok=9", "num_experts=8"]),
    (dict(use_sliding_window=True, sliding_window=16,
          layer_types=["sliding_attention", "full_attention", "full_attention"]), ["layer_types=", "sliding"]),
])
def test_bad_moe_configs_are_refused(changes, words, checkpoint_dir, tmp_path):
    import json
    import shutil

    path = tmp_path / "bad"
    shutil.copytree(checkpoint_dir("qwen2_moe"), path)
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        LLM(str(path), num_kv_blocks=16)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_tensor_parallel_must_divide_the_expert_size(checkpoint_dir, tmp_path):
    import json
    import shutil

    path = tmp_path / "odd"
    shutil.copytree(checkpoint_dir("qwen3_moe"), path)
    config = json.loads((path / "config.json").read_text())
    config["moe_intermediate_size"] = 33
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="moe_intermediate_size=33"):
        LLM(str(path), tensor_parallel_size=2, num_kv_blocks=16)
