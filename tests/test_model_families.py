"""The dense families beyond Llama (Qwen3, Gemma 2, Gemma 3, Phi-3): greedy tokens equal to
transformers on tiny random checkpoints (float32, initializer_range 0.1), log-probs within 1e-4,
through chunked prefill, prefix caching, preemption, tensor and pipeline parallelism; bfloat16
runs. The tiny configs (omniinfer.testing.tiny_models.FAMILY_SETTINGS) make each family's
peculiarity matter: Gemma's windows of 8 tokens, soft caps of 2 and 3, a query_pre_attn_scalar
unlike head_dim; Gemma 3's linear rope scaling on its global layer; Phi-3's longrope with an
original context of 64 tokens; Phi-4-mini's partial rotary (12 of 16 features)."""

from __future__ import annotations

import random

import pytest
import torch
from test_parity import check_parity, make_prompts

from omniinfer import LLM, SamplingParams
from omniinfer.testing.processes import assert_no_child_processes

FAMILIES = ["qwen3", "gemma2", "gemma3", "phi3", "phi3_partial"]
# Phi-3 switches to its long factors past 64 tokens, where transformers' generate() disagrees
# with its own forward pass over a cache (test_phi3_longrope_past_the_original_context)
SHORT = [1, 7, 8, 9, 15, 17, 31, 33]


def prompts_for(name: str) -> list[list[int]]:
    return make_prompts(300, SHORT if name.startswith("phi3") else [1, 7, 8, 9, 15, 16, 17, 31, 33, 40])


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_matches_transformers(name, checkpoint_dir, hf_greedy):
    check_parity(checkpoint_dir(name), hf_greedy, prompts_for(name), num_kv_blocks=128)


@pytest.mark.parametrize("name", FAMILIES)
def test_chunked_prefill_prefix_caching_and_preemption(name, checkpoint_dir, hf_greedy):
    rng = random.Random(4)
    prefix = [rng.randrange(3, 300) for _ in range(17)]
    prompts = make_prompts(300, [5, 30, 9]) + [prefix + p for p in make_prompts(300, [3, 11, 8])]
    llm = check_parity(checkpoint_dir(name), hf_greedy, prompts, max_tokens=16, block_size=8,
                       num_kv_blocks=20, enable_chunked_prefill=True, max_num_batched_tokens=12,
                       max_num_seqs=6, enable_prefix_caching=True)
    stats = llm.llm_engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("name", FAMILIES)
def test_logprobs_match_transformers(name, checkpoint_dir, hf_logprobs):
    llm = LLM(checkpoint_dir(name), num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    prompt = make_prompts(300, [21])[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    ref = hf_logprobs(checkpoint_dir(name), prompt + out.outputs[0].token_ids)
    for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + i]
        top = torch.topk(row, 3)
        for value, tid in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[tid].logprob - value) < 1e-4, (i, tid)
        assert entry[token].rank == 1
    for j in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[j][prompt[j]].logprob - ref[j - 1][prompt[j]].item()) < 1e-4


def test_phi3_longrope_past_the_original_context(checkpoint_dir):
    """Past original_max_position_embeddings (64) a token is rotated with the long factors, as
    transformers' forward over a cache rotates it: log-probs of tokens 60..79 one at a time."""
    from transformers import AutoModelForCausalLM

    path = checkpoint_dir("phi3")
    tokens = make_prompts(300, [80], seed=5)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        out = hf(torch.tensor([tokens[:60]]), use_cache=True)
        cache = out.past_key_values
        for p in range(60, 80):
            out = hf(torch.tensor([[tokens[p]]]), cache=cache,
                     position_ids=torch.tensor([[p]]), use_cache=True)
            cache = out.past_key_values
            expected.append(torch.log_softmax(out.logits[0, -1], -1))
    llm = LLM(path, num_kv_blocks=64)
    got = llm.generate({"prompt_token_ids": tokens}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0].prompt_logprobs
    for p in range(61, 80):  # prompt_logprobs[p] is the log-prob of token p given 0..p-1
        assert abs(got[p][tokens[p]].logprob - expected[p - 61][tokens[p]].item()) < 1e-4, p


@pytest.mark.parametrize("name,layout", [
    ("qwen3", dict(tensor_parallel_size=2)),
    ("gemma2", dict(tensor_parallel_size=2)),
    ("gemma3", dict(tensor_parallel_size=2)),
    ("gemma3", dict(pipeline_parallel_size=2)),
    ("phi3", dict(tensor_parallel_size=2)),
    ("phi3", dict(pipeline_parallel_size=2)),
    ("phi3_partial", dict(tensor_parallel_size=2)),
])
def test_parallel_matches_transformers(name, layout, checkpoint_dir, hf_greedy):
    llm = check_parity(checkpoint_dir(name), hf_greedy, make_prompts(300, [9, 17, 20, 12]),
                       max_tokens=12, block_size=8, num_kv_blocks=16, max_num_batched_tokens=12,
                       max_num_seqs=4, **layout)
    llm.shutdown()
    assert_no_child_processes()


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_runs(name, checkpoint_dir):
    llm = LLM(checkpoint_dir(name), dtype="bfloat16", num_kv_blocks=32)
    out = llm.generate([{"prompt_token_ids": p} for p in make_prompts(300, [5, 19])],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    assert all(0 <= t < llm.llm_engine.config.model.vocab_size for o in out for t in o.outputs[0].token_ids)
