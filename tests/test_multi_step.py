"""Multi-step decoding (`num_scheduler_steps`): several decode steps per scheduling step give the
tokens one step at a time gives, and transformers' greedy ones."""

from __future__ import annotations

import pytest
from test_parity import MAX_TOKENS, make_prompts

from omniinfer import LLM, SamplingParams
from omniinfer.config import EngineArgs


def record_steps(llm: LLM) -> list[int]:
    """The `num_steps` of every schedule the engine makes from now on."""
    scheduler = llm.llm_engine.scheduler
    schedule, seen = scheduler.schedule, []

    def recording():
        out = schedule()
        seen.append(out.num_steps)
        return out

    scheduler.schedule = recording
    return seen


def generate(llm: LLM, prompts, params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("name,block_size,steps", [("llama", 8, 5), ("mistral_window", 16, 8),
                                                   ("qwen2", 16, 3)])
def test_greedy_parity(name, block_size, steps, checkpoint_dir, hf_greedy):
    """Block edges crossed inside a run of steps, a sliding window, biases; max_tokens caps the
    last run (24 tokens: not a multiple of 5, 8 or 3)."""
    llm = LLM(checkpoint_dir(name), block_size=block_size, num_kv_blocks=256,
              num_scheduler_steps=steps)
    seen = record_steps(llm)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = make_prompts(300)
    for prompt, out in zip(prompts, generate(llm, prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(llm.llm_engine.config.model.model, prompt,
                                                     MAX_TOKENS)
        assert out.outputs[0].finish_reason == "length"
    assert steps in seen and max(seen) == steps
    stats = llm.llm_engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"], "blocks leaked"


def test_short_of_blocks_and_everything_else(checkpoint_dir, hf_greedy):
    """Chunked prefill, prefix caching, swapping preemption and a cache too small to reserve
    every step: runs of steps happen where they fit, single steps elsewhere, same tokens."""
    path = checkpoint_dir("llama")
    prefix = make_prompts(300, [19], seed=5)[0]
    prompts = make_prompts(300, [5, 30, 17, 9]) + [prefix + p for p in make_prompts(300, [3, 11, 8])]
    llm = LLM(path, block_size=8, num_kv_blocks=24, max_num_batched_tokens=12, max_num_seqs=6,
              enable_prefix_caching=True, preemption_mode="swap", swap_space=0.01,
              num_scheduler_steps=4)
    seen = record_steps(llm)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, out in zip(prompts, generate(llm, prompts, params)):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_TOKENS)
    stats = llm.llm_engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"], "blocks leaked"
    assert 4 in seen and 1 in seen


def test_sampling_and_stops_match_single_steps(checkpoint_dir):
    """Seeded random sampling, log-probs, stop tokens and stop strings hit in the middle of a run
    of steps, n > 1: the outputs are those of one step at a time, and the finished sequences'
    blocks come back."""
    path = checkpoint_dir("llama")
    prompts = make_prompts(300, [7, 12, 20, 3, 16])
    probe = LLM(path, num_kv_blocks=128)
    greedy = generate(probe, prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop_token = greedy[1].outputs[0].token_ids[6]  # 7th token of the second prompt
    stop_text = greedy[3].outputs[0].text[2:6] or None
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_token], ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=17, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, stop=stop_text, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=13, ignore_eos=True),
    ]
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = probe.generate(requests, params, use_tqdm=False)
    llm = LLM(path, num_kv_blocks=128, num_scheduler_steps=6)
    seen = record_steps(llm)
    got = llm.generate(requests, params, use_tqdm=False)
    assert max(seen) == 6
    for e, g in zip(expected, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
        assert [c.text for c in g.outputs] == [c.text for c in e.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in e.outputs]
        assert [c.stop_reason for c in g.outputs] == [c.stop_reason for c in e.outputs]
        assert [c.logprobs for c in g.outputs] == [c.logprobs for c in e.outputs]
    assert got[1].outputs[0].stop_reason == stop_token and len(got[1].outputs[0].token_ids) < 20
    stats = llm.llm_engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"], "blocks leaked"


def test_sampling_that_reads_history_steps_once(checkpoint_dir):
    """Penalties and an unmet min_tokens read the tokens of the previous step: such batches run
    one step at a time, and give the tokens they give without multi-step decoding."""
    path = checkpoint_dir("llama")
    prompts = make_prompts(300, [7, 12])
    params = [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, min_tokens=12)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    expected = LLM(path, num_kv_blocks=64).generate(requests, params, use_tqdm=False)
    llm = LLM(path, num_kv_blocks=64, num_scheduler_steps=4)
    seen = record_steps(llm)
    got = llm.generate(requests, params, use_tqdm=False)
    assert set(seen) == {1}
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_streamed_outputs_arrive_per_run(checkpoint_dir):
    """A streamed request reports once per run of steps, with every token of the run."""
    llm = LLM(checkpoint_dir("llama"), num_kv_blocks=64, num_scheduler_steps=4)
    engine = llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    counts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts.append(len(out.outputs[0].token_ids))
    assert counts == [1, 5, 9, 10]  # the prefill's token, then 4, 4 and the last 1 (max_tokens)
    assert engine.groups == {} and engine.scheduler.running == []


def test_defaults(checkpoint_dir):
    """The offline LLM class runs 8 steps per schedule (1 with a speculative model); the engine
    itself, as the server builds it, runs 1."""
    path = checkpoint_dir("llama")

    def steps(**kwargs):
        with LLM(path, num_kv_blocks=16, **kwargs) as llm:
            return llm.llm_engine.config.scheduler.num_scheduler_steps

    assert steps() == steps(num_scheduler_steps=None) == 8
    assert steps(num_scheduler_steps=1) == 1
    assert steps(speculative_model=path, num_speculative_tokens=2) == 1
    assert EngineArgs(model=path).create_engine_config().scheduler.num_scheduler_steps == 1


@pytest.mark.parametrize("value", [0, -1, 65, 2.0, True])
def test_bad_num_scheduler_steps(value, checkpoint_dir):
    with pytest.raises((ValueError, TypeError), match="num_scheduler_steps"):
        LLM(checkpoint_dir("llama"), num_scheduler_steps=value)


def test_not_with_speculative_decoding(checkpoint_dir):
    with pytest.raises(ValueError, match="num_scheduler_steps=4.*speculative"):
        LLM(checkpoint_dir("llama"), speculative_model=checkpoint_dir("llama"),
            num_speculative_tokens=2, num_scheduler_steps=4)
