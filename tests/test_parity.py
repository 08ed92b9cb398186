"""Greedy output token-identical to transformers, through every scheduling path."""

from __future__ import annotations

import random

import pytest
import torch

from omniinfer import LLM, SamplingParams

MAX_TOKENS = 24
# prompt lengths straddling block edges for block sizes 8, 16 and 32
LENGTHS = [1, 7, 8, 9, 15, 16, 17, 31, 33, 40]


def make_prompts(vocab: int, lengths=LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def check_parity(path, hf_greedy, prompts, max_tokens=MAX_TOKENS, **engine_kwargs):
    llm = LLM(path, **engine_kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(path, prompt, max_tokens)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert out.outputs[0].finish_reason == "length"
    stats = llm.llm_engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"], "blocks leaked"
    return llm


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "llama_tied", "llama3_rope",
                                  "llama_sharded", "mistral_window"])
def test_architectures(name, checkpoint_dir, hf_greedy):
    check_parity(checkpoint_dir(name), hf_greedy, make_prompts(300), num_kv_blocks=128)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_block_sizes(block_size, checkpoint_dir, hf_greedy):
    path = checkpoint_dir("llama")
    check_parity(path, hf_greedy, make_prompts(300), block_size=block_size, num_kv_blocks=2048 // block_size)


@pytest.mark.parametrize("chunked,budget", [(False, None), (True, 8), (True, 20), (True, 64)])
def test_chunked_prefill(chunked, budget, checkpoint_dir, hf_greedy):
    path = checkpoint_dir("llama")
    kwargs = dict(enable_chunked_prefill=chunked, num_kv_blocks=128)
    if budget:
        kwargs.update(max_num_batched_tokens=budget, max_num_seqs=min(budget, 8))
    check_parity(path, hf_greedy, make_prompts(300), **kwargs)


@pytest.mark.parametrize("backend", ["REFERENCE", "TORCH_SDPA"])
def test_attention_backends_mixed_batches(backend, checkpoint_dir, hf_greedy):
    """Chunked prefill + prefix hits + sliding window through each CPU backend."""
    path = checkpoint_dir("mistral_window")
    rng = random.Random(3)
    prefix = [rng.randrange(3, 300) for _ in range(16)]
    prompts = make_prompts(300, [30, 3]) + [prefix + p for p in make_prompts(300, [9, 20])]
    check_parity(path, hf_greedy, prompts, attention_backend=backend, block_size=8,
                 num_kv_blocks=64, max_num_batched_tokens=10, max_num_seqs=4,
                 enable_prefix_caching=True)


def test_prefix_caching_reuses_shared_prefixes(checkpoint_dir, hf_greedy):
    path = checkpoint_dir("llama")
    rng = random.Random(1)
    prefix = [rng.randrange(3, 300) for _ in range(40)]
    prompts = [prefix + [rng.randrange(3, 300) for _ in range(n)] for n in (1, 5, 16, 23)]
    llm = check_parity(path, hf_greedy, prompts[:1], enable_prefix_caching=True, num_kv_blocks=128)
    engine = llm.llm_engine
    computed_before = engine.stats()["num_prompt_tokens"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    for prompt, out in zip(prompts[1:], outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS)
    assert computed_before > 0
    assert engine.stats()["prefix_cache_hit_rate"] > 0.5


def test_prefix_caching_skips_cached_tokens(checkpoint_dir):
    """The cached prefix is not recomputed: the second request schedules only its tail."""
    path = checkpoint_dir("llama")
    llm = LLM(path, enable_prefix_caching=True, num_kv_blocks=64, block_size=16)
    engine = llm.llm_engine
    prompt = list(range(10, 60))  # 50 tokens: 3 full blocks
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    engine.add_request("again", {"prompt_token_ids": prompt}, params)
    sched = engine.scheduler.schedule()
    assert sched.num_scheduled_tokens == [50 - 48] and sched.num_computed_tokens == [48]
    assert sched.token_ids == prompt[48:]
    engine.abort_request("again")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(mode, checkpoint_dir, hf_greedy):
    path = checkpoint_dir("llama")
    prompts = make_prompts(300, [9, 17, 20, 12, 25, 16])
    llm = check_parity(path, hf_greedy, prompts, block_size=8, num_kv_blocks=14,
                       preemption_mode=mode, swap_space=0.01)
    assert llm.llm_engine.stats()["num_preemptions"] > 0


def test_everything_at_once(checkpoint_dir, hf_greedy):
    path = checkpoint_dir("qwen2")
    rng = random.Random(2)
    prefix = [rng.randrange(3, 300) for _ in range(19)]
    prompts = make_prompts(300, [5, 30, 17, 9]) + [prefix + p for p in make_prompts(300, [3, 11, 8])]
    llm = check_parity(path, hf_greedy, prompts, block_size=8, num_kv_blocks=24,
                       enable_chunked_prefill=True, max_num_batched_tokens=12, max_num_seqs=6,
                       enable_prefix_caching=True, preemption_mode="swap", swap_space=0.01)
    assert llm.llm_engine.stats()["num_preemptions"] > 0


def test_logprobs_match_reference(checkpoint_dir, hf_logprobs):
    path = checkpoint_dir("llama")
    llm = LLM(path, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    prompt = make_prompts(300, [21])[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    ref = hf_logprobs(path, prompt + completion.token_ids)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == 1  # greedy picks the most likely token
        top = torch.topk(row, 3)
        for value, tid in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[tid].logprob - value) < 1e-4
    assert abs(completion.cumulative_logprob - sum(e[t].logprob for t, e in
                                                   zip(completion.token_ids, completion.logprobs))) < 1e-4
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for j in range(1, len(prompt)):
        entry = out.prompt_logprobs[j]
        assert abs(entry[prompt[j]].logprob - ref[j - 1][prompt[j]].item()) < 1e-4
        assert len(entry) in (2, 3)


def test_bfloat16_checkpoint_auto_dtype(checkpoint_dir):
    path = checkpoint_dir("llama_bf16")
    llm = LLM(path, num_kv_blocks=32)
    assert llm.llm_engine.config.model.dtype == torch.bfloat16
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4,
                                                                        ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_track_float32(dtype, checkpoint_dir, hf_greedy):
    """Lower precisions run and stay close to the float32 reference (first tokens agree)."""
    path = checkpoint_dir("llama")
    llm = LLM(path, dtype=dtype, num_kv_blocks=32)
    prompt = make_prompts(300, [12])[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3,
                                                                     ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids[:1] == hf_greedy(path, prompt, MAX_TOKENS)[:1]


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_penalties_and_min_tokens_see_the_generated_tokens(checkpoint_dir, num_scheduler_steps):
    """The sampler runs in the worker, which learns a sequence's generated tokens only from the
    scheduler (SchedulerOutput.token_history): a repetition penalty over prompt and output, and
    min_tokens, give transformers' greedy tokens with the same processors, one step or four per
    schedule (what reaches the worker each step: test_scheduler.py)."""
    from transformers import AutoModelForCausalLM

    path = checkpoint_dir("llama")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = make_prompts(300, [5, 12, 3, 7])
    llm = LLM(path, num_kv_blocks=64, num_scheduler_steps=num_scheduler_steps)
    eos = llm.llm_engine.eos_token_ids
    cases = ((dict(repetition_penalty=1.8, ignore_eos=True), dict(repetition_penalty=1.8), None),
             (dict(min_tokens=10), dict(min_new_tokens=10), eos))
    for kwargs, hf_kwargs, eos_ids in cases:
        params = SamplingParams(temperature=0, max_tokens=16, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                   do_sample=False, pad_token_id=0, eos_token_id=eos_ids, **hf_kwargs)
            assert out.outputs[0].token_ids == want[0, len(prompt):].tolist(), kwargs
