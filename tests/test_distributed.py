"""Distributed execution on CPU (gloo, float32): tensor and pipeline parallelism give the same
greedy tokens as one rank, the control plane sends exactly one broadcast per step, the
broadcast dict survives the wire, and bad parallel sizes fail before anything starts."""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from omniinfer import LLM, SamplingParams
from omniinfer.distributed import parallel_state as ps
from omniinfer.distributed.communication import BroadcastStats, broadcast_tensor_dict, pack, unpack
from omniinfer.executor.distributed import free_port
from omniinfer.testing.processes import assert_no_child_processes
from omniinfer.worker.model_input import ModelInput, WorkerInput

MAX_TOKENS = 16


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert_no_child_processes()
    assert not torch.distributed.is_initialized()


def make_prompts(lengths, vocab=300, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# chunked prefill (a 12-token budget) and forced preemption (10 blocks of 8 tokens)
STRESS = dict(block_size=8, num_kv_blocks=10, max_num_batched_tokens=12, max_num_seqs=4)
STRESS_PROMPTS = make_prompts([9, 17, 20, 12, 25, 16])


def generate(path, prompts, params=None, **kwargs):
    """(token ids per prompt, engine stats, (broadcasts, steps)) of one engine run; steps counts
    decode steps (a multi-step run is several)."""
    params = params or SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, **kwargs) as llm:
        engine = llm.llm_engine
        steps = 0
        execute = engine.executor.execute_model

        def counted(request):
            nonlocal steps
            steps += request.num_steps
            return execute(request)

        engine.executor.execute_model = counted
        BroadcastStats.reset()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        broadcasts = BroadcastStats.num_broadcasts
        stats = engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"], "blocks leaked"
    return outs, stats, (broadcasts, steps)


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def one_rank(checkpoint_dir):
    """The single-rank reference for each (checkpoint, settings), computed once."""
    cache = {}

    def run(name, prompts=STRESS_PROMPTS, params=None, **kwargs):
        key = (name, str(prompts), repr(params), tuple(sorted(kwargs.items())))
        if key not in cache:
            outs, stats, (broadcasts, steps) = generate(checkpoint_dir(name), prompts, params, **kwargs)
            assert broadcasts == 0 and steps > 0  # one rank: no broadcast at all
            cache[key] = (outs, stats)
        return cache[key]

    return run


def test_tensor_parallel_matches_one_rank(checkpoint_dir, one_rank):
    """TP=2 with chunked prefill, recompute preemption and an n=2 fork (copy-on-write)."""
    path = checkpoint_dir("llama")
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             n=2 if i == 1 else 1) for i in range(len(STRESS_PROMPTS))]
    ref, ref_stats = one_rank("llama", params=params, **STRESS)
    outs, stats, (broadcasts, steps) = generate(path, STRESS_PROMPTS, params,
                                                tensor_parallel_size=2, **STRESS)
    assert tokens(outs) == tokens(ref)
    assert stats["num_preemptions"] > 0 and ref_stats["num_preemptions"] > 0
    assert broadcasts == steps > 0, "exactly one broadcast per step"


def test_pipeline_parallel_matches_one_rank(checkpoint_dir, one_rank):
    """PP=2 with chunked prefill, swap preemption, and logprobs (logits travel back to the driver)."""
    path = checkpoint_dir("qwen2")
    kwargs = dict(STRESS, preemption_mode="swap", swap_space=0.01)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    ref, ref_stats = one_rank("qwen2", params=params, **kwargs)
    outs, stats, (broadcasts, steps) = generate(path, STRESS_PROMPTS, params,
                                                pipeline_parallel_size=2, **kwargs)
    assert tokens(outs) == tokens(ref)
    assert stats["num_preemptions"] > 0
    assert broadcasts == steps > 0
    for out, expected in zip(outs, ref):
        got, want = out.outputs[0], expected.outputs[0]
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
        for a, b in zip(out.prompt_logprobs[1:], expected.prompt_logprobs[1:]):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_kv_head_replication_and_padded_vocab(checkpoint_dir, one_rank):
    """1 KV head on 2 ranks (replicated), a vocabulary of 389 rows split into 195 + 194."""
    path = checkpoint_dir("llama_kv1")
    ref, _ = one_rank("llama_kv1", **STRESS)
    outs, _, _ = generate(path, STRESS_PROMPTS, tensor_parallel_size=2, **STRESS)
    assert tokens(outs) == tokens(ref)


@pytest.mark.parametrize("tp,pp,name", [
    (2, 2, "llama"),
    pytest.param(4, 1, "llama_tied", marks=pytest.mark.slow),  # 2 KV heads on 4 ranks
    pytest.param(2, 2, "llama_kv1", marks=pytest.mark.slow),
])
def test_tensor_and_pipeline_parallel_together(tp, pp, name, checkpoint_dir, one_rank):
    kwargs = dict(STRESS, preemption_mode="swap", swap_space=0.01)
    ref, _ = one_rank(name, **kwargs)
    outs, stats, (broadcasts, steps) = generate(checkpoint_dir(name), STRESS_PROMPTS,
                                                tensor_parallel_size=tp,
                                                pipeline_parallel_size=pp, **kwargs)
    assert tokens(outs) == tokens(ref)
    assert stats["num_preemptions"] > 0 and broadcasts == steps


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_multi_step_decoding_across_ranks(layout, checkpoint_dir, one_rank):
    """num_scheduler_steps=4 on two ranks: the single-rank, single-step tokens, and one broadcast
    per decode step (each step of a run goes out like any other)."""
    kwargs = dict(block_size=8, num_kv_blocks=64, max_num_seqs=4)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    ref, _ = one_rank("llama", params=params, **kwargs)
    with LLM(checkpoint_dir("llama"), num_scheduler_steps=4, **layout, **kwargs) as llm:
        engine = llm.llm_engine
        execute, runs = engine.executor.execute_model, []

        def counted(request):
            runs.append(request.num_steps)
            return execute(request)

        engine.executor.execute_model = counted
        BroadcastStats.reset()
        outs = llm.generate([{"prompt_token_ids": p} for p in STRESS_PROMPTS], params, use_tqdm=False)
        assert BroadcastStats.num_broadcasts == sum(runs)
    assert tokens(outs) == tokens(ref)
    assert max(runs) == 4


# ---- the broadcast dict over a real gloo group ----------------------------------------------------
_ECHO = textwrap.dedent("""
    import sys
    from omniinfer.distributed import parallel_state as ps
    from omniinfer.distributed.communication import broadcast_tensor_dict
    ps.init_distributed_environment(1, 2, sys.argv[1], "gloo")
    while (values := broadcast_tensor_dict(None, src=0)):
        broadcast_tensor_dict(values, src=1)
    ps.destroy_distributed_environment()
""")


def _fields_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_fields_equal(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    return a == b


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_a_lone_prompt_longer_than_a_step_across_ranks(layout, checkpoint_dir, one_rank):
    """A prompt alone, in three chunks: the first two sample nothing, so the step's
    logits_indices are empty (made by numpy: stride 0, which the broadcast could not pack, and
    every rank failed)."""
    kwargs = dict(max_num_batched_tokens=12, max_num_seqs=4)
    prompts = make_prompts([30])
    ref, _ = one_rank("llama", prompts=prompts, **kwargs)
    outs, _, (broadcasts, steps) = generate(checkpoint_dir("llama"), prompts, **layout, **kwargs)
    assert tokens(outs) == tokens(ref) and broadcasts == steps > MAX_TOKENS


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_allowed_tokens_and_bad_words_across_ranks(layout, checkpoint_dir, one_rank):
    """The rank that samples (the last pipeline stage is another process) gets the bad words'
    token ids the engine made with its tokenizer, and each step's output history."""
    from collections import Counter

    from transformers import AutoTokenizer

    path = checkpoint_dir("llama")
    allowed = list(range(40, 80))
    greedy = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, allowed_token_ids=allowed)
    only, _ = one_rank("llama", params=SamplingParams(**greedy), **STRESS)
    common = Counter(t for o in tokens(only) for c in o for t in c).most_common(1)[0][0]
    tokenizer = AutoTokenizer.from_pretrained(path)
    word = tokenizer.decode([common])
    assert tokenizer(word, add_special_tokens=False).input_ids == [common]
    params = SamplingParams(**greedy, bad_words=[word])
    ref, _ = one_rank("llama", params=params, **STRESS)
    outs, _, _ = generate(path, STRESS_PROMPTS, params, **layout, **STRESS)
    assert tokens(outs) == tokens(ref)
    flat = [t for o in tokens(outs) for c in o for t in c]
    assert set(flat) <= set(allowed) and common not in flat


def test_empty_tensors_pack_and_unpack():
    """Empty tensors, numpy's (stride 0) among them, beside full ones."""
    import numpy as np

    sent = {"numpy_empty": torch.from_numpy(np.concatenate([np.arange(0)]).astype(np.int64)),
            "full": torch.arange(5, dtype=torch.int32), "rows": torch.zeros(0, 7), "n": 3,
            "after": torch.tensor([1.5, -2.0], dtype=torch.float64)}
    assert sent["numpy_empty"].stride() == (0,)
    got = unpack(pack(sent)[0])
    assert got.keys() == sent.keys() and got["n"] == 3
    for key in ("numpy_empty", "full", "rows", "after"):
        assert got[key].dtype == sent[key].dtype and torch.equal(got[key], sent[key]), key


def test_broadcast_dict_round_trips_over_gloo(checkpoint_dir):
    """Every ModelInput / WorkerInput field goes driver -> rank 1 -> driver intact (a real
    step's inputs: a mixed prefill/decode batch with swaps and copies)."""
    with LLM(checkpoint_dir("llama"), **STRESS) as llm:
        engine = llm.llm_engine
        for p in STRESS_PROMPTS[:3]:
            engine.add_request(str(len(engine.groups)), {"prompt_token_ids": p},
                               SamplingParams(max_tokens=4, ignore_eos=True))
        engine.step()
        sched = engine.scheduler.schedule()
        sched.blocks_to_swap_in, sched.blocks_to_copy = [(0, 1), (2, 3)], [(4, 5)]
        worker = engine.executor.worker
        worker_input = WorkerInput.from_schedule(sched)
        worker.model_runner.update_states(sched)
        model_input = worker.model_runner.prepare_model_input(sched)
        metadata_cls = type(model_input.attn_metadata)
        assert model_input.attn_metadata.num_prefills and model_input.attn_metadata.num_decodes
    init_method = f"tcp://127.0.0.1:{free_port()}"
    echo = subprocess.Popen([sys.executable, "-c", _ECHO, init_method])
    try:
        ps.init_distributed_environment(0, 2, init_method, "gloo")
        sent = {**worker_input.as_broadcastable_tensor_dict(),
                **model_input.as_broadcastable_tensor_dict()}
        broadcast_tensor_dict(sent, src=0)
        back = broadcast_tensor_dict(None, src=1)
        broadcast_tensor_dict({}, src=0)  # the stop signal ends the echo loop
    finally:
        ps.destroy_distributed_environment()
        echo.wait(timeout=30)
    assert back.keys() == sent.keys()
    assert _fields_equal(WorkerInput.from_broadcasted_tensor_dict(back), worker_input)
    again = ModelInput.from_broadcasted_tensor_dict(back, metadata_cls)
    for f in dataclasses.fields(ModelInput):
        if f.name not in ("sampling_metadata", "common"):  # driver only, never broadcast
            assert _fields_equal(getattr(again, f.name), getattr(model_input, f.name)), f.name


# ---- sizes refused at start --------------------------------------------------------------------------
def _edited_checkpoint(src, dst, **changes):
    import json
    import shutil

    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.mark.parametrize("kwargs,changes,words", [
    (dict(tensor_parallel_size=3), {}, ["tensor_parallel_size=3", "num_attention_heads=4"]),
    (dict(tensor_parallel_size=2), dict(num_attention_heads=12, num_key_value_heads=3, head_dim=8),
     ["tensor_parallel_size=2", "num_key_value_heads=3"]),
    (dict(tensor_parallel_size=2), dict(intermediate_size=129), ["intermediate_size=129"]),
    (dict(pipeline_parallel_size=3), {}, ["pipeline_parallel_size=3", "num_hidden_layers=2"]),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uniprocess"), {},
     ["'uniprocess'", "2", "'mp'"]),
    (dict(distributed_executor_backend="mpi"), {}, ["'mpi'", "'mp'", "'ray'"]),
    (dict(worker_cls="nowhere.Worker"), {}, ["worker_cls='nowhere.Worker'", "cannot be imported"]),
])
def test_bad_parallel_settings_fail_at_start(kwargs, changes, words, checkpoint_dir, tmp_path):
    path = checkpoint_dir("llama")
    if changes:
        path = _edited_checkpoint(path, tmp_path / "edited", **changes)
    with pytest.raises(ValueError) as info:
        LLM(path, **kwargs)
    for word in words:
        assert word in str(info.value)


def test_more_ranks_than_devices_is_refused(checkpoint_dir, monkeypatch):
    from omniinfer.platforms.registry import get_registry

    platform = get_registry().select_platform(None)
    monkeypatch.setattr(platform, "max_local_ranks", classmethod(lambda cls: 1))
    with pytest.raises(ValueError, match=r"2 ranks, but platform cpu has 1 device\(s\)"):
        LLM(checkpoint_dir("llama"), tensor_parallel_size=2)


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_speculative_draft_runs_on_the_driver_only(layout, checkpoint_dir, tmp_path):
    """The target is split across ranks; the draft is whole on the driver. Greedy output
    equals one rank without speculation."""
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    path = checkpoint_dir("llama")
    draft = build_tiny_checkpoint(str(tmp_path / "draft"), "llama", num_hidden_layers=1, seed=1)
    prompts = make_prompts([5, 17, 9])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected, _, _ = generate(path, prompts, params, num_kv_blocks=64)
    got, stats, _ = generate(path, prompts, params, num_kv_blocks=64, speculative_model=draft,
                             num_speculative_tokens=3, **layout)
    assert tokens(got) == tokens(expected)
    assert stats["num_spec_proposed_tokens"] > 0
