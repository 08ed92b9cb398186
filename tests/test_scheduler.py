"""The scheduler's budget rules, checked every step of simulated workloads (no model): each step
goes out as plain data and comes back as a ModelRunnerOutput of made-up tokens."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from omniinfer.config import CacheConfig, SchedulerConfig
from omniinfer.engine.scheduler import Scheduler
from omniinfer.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from omniinfer.sampling.params import SamplingParams
from omniinfer.step import ModelRunnerOutput


def make_scheduler(budget=32, max_seqs=8, blocks=64, chunked=True, block_size=4, host=0,
                   mode="recompute", caching=False, max_len=256, rows=None):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                        enable_chunked_prefill=chunked, preemption_mode=mode),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching), blocks, host,
        prompt_logprob_rows=rows)


def add(s: Scheduler, seq_id: int, prompt_len: int, max_tokens: int = 8, **params) -> Sequence:
    group = SequenceGroup(f"r{seq_id}", None, list(range(prompt_len)), SamplingParams(**params),
                          max_tokens=max_tokens)
    seq = s.add_request(group)
    assert seq.seq_id == seq_id  # the scheduler numbers sequences in order
    return seq


def step(s: Scheduler, check=None):
    """Schedule, check the rules, pretend the model ran (each sampling seq gets token 1)."""
    plain = s.schedule()
    out = SimpleNamespace(scheduled=list(s.scheduled), plain=plain,
                          num_preempted=s._num_preempted, blocks_to_swap_in=plain.blocks_to_swap_in,
                          blocks_to_swap_out=plain.blocks_to_swap_out)
    budget = s.config.max_num_batched_tokens
    assert sum(plain.num_scheduled_tokens) <= budget
    assert plain.seq_ids == [x.seq.seq_id for x in out.scheduled]
    assert len(s.running) <= s.config.max_num_seqs
    scheduled = {x.seq.seq_id: x for x in out.scheduled}
    # decodes first: a running decode left out while a prefill chunk got budget is a violation
    chunks = [x for x in out.scheduled if x.seq.num_tokens - x.seq.num_computed_tokens > 1]
    if chunks:
        for seq in s.running:
            if seq.num_tokens - seq.num_computed_tokens == 1:
                assert seq.seq_id in scheduled, "a decode was starved by a prefill chunk"
    if not s.config.enable_chunked_prefill:
        for x in out.scheduled:
            assert x.num_new_tokens == x.seq.num_tokens - x.seq.num_computed_tokens, "prompt split"
    for x in out.scheduled:
        table = s.blocks.tables[x.seq.seq_id]
        assert len(table) * s.block_size >= x.seq.num_computed_tokens + x.num_new_tokens
    if check:
        check(out)
    sampled = [x.seq.seq_id for x in out.scheduled if x.is_sampling]
    s.update_from_output(plain, ModelRunnerOutput(seq_ids=sampled, token_ids=[[1]] * len(sampled),
                                                  prompt_logprobs=prompt_entries(s, plain)))
    return out


def prompt_entries(s: Scheduler, plain) -> dict:
    """The prompt log-prob entries the workers would return for this schedule (empty dicts; as
    worker/input_builder.py's _prompt_rows counts them: position p predicts token p + 1)."""
    out = {}
    for seq_id, done in plain.prompt_logprobs.items():
        i = plain.seq_ids.index(seq_id)
        ctx, q = plain.num_computed_tokens[i], plain.num_scheduled_tokens[i]
        first, last = max(ctx, done - 1), min(ctx + q, len(s.seqs[seq_id].group.prompt_token_ids) - 1)
        if last > first:
            out[seq_id] = (first + 1, [{}] * (last - first))
    return out


def run_all(s: Scheduler, limit=500, check=None):
    steps = 0
    while s.num_unfinished:
        step(s, check)
        steps += 1
        assert steps < limit, "no progress"
    assert s.blocks.num_free_blocks == s.blocks.num_total_blocks
    return steps


def test_long_prompt_is_chunked_and_only_last_chunk_samples():
    s = make_scheduler(budget=10)
    seq = add(s, 0, 25)
    sizes, sampling = [], []
    while seq.num_output_tokens == 0:
        out = step(s)
        sizes.append(out.scheduled[0].num_new_tokens)
        sampling.append(out.scheduled[0].is_sampling)
    assert sizes == [10, 10, 5]
    assert sampling == [False, False, True]


def test_decodes_first_then_prefill_chunks_share_the_budget():
    s = make_scheduler(budget=8)
    a = add(s, 0, 3, max_tokens=20)
    step(s)  # a's prompt
    b = add(s, 1, 30)

    def check(out):  # (the budget went to the decode first: `step` checks no decode starves)
        if b.seq_id in out.plain.seq_ids and a.seq_id in out.plain.seq_ids:  # batch order:
            assert out.plain.seq_ids == [b.seq_id, a.seq_id] and out.plain.num_prefills == 1

    out = step(s, check)
    by_id = {x.seq.seq_id: x.num_new_tokens for x in out.scheduled}
    assert by_id == {a.seq_id: 1, b.seq_id: 7}  # one step mixes a decode and a chunk


def test_chunking_off_schedules_whole_prompts_fcfs():
    s = make_scheduler(budget=64, chunked=False, max_len=64)
    seqs = [add(s, i, n) for i, n in enumerate([30, 30, 10])]
    out = step(s)
    assert [x.seq.seq_id for x in out.scheduled] == [0, 1]  # 30 + 30; 10 waits (FCFS, budget)
    assert seqs[2].status == SequenceStatus.WAITING
    run_all(s)


def test_max_num_seqs_caps_running():
    s = make_scheduler(budget=64, max_seqs=3)
    for i in range(6):
        add(s, i, 2)
    out = step(s)
    assert len(out.scheduled) == 3 and len(s.waiting) == 3
    run_all(s)


def test_preemption_takes_the_latest_arrival_and_outputs_continue():
    s = make_scheduler(budget=64, blocks=6, block_size=4)
    a = add(s, 0, 8, max_tokens=12)
    b = add(s, 1, 8, max_tokens=12)
    step(s)
    preempted = []

    def check(out):
        if out.num_preempted:
            preempted.append([x for x in (a, b) if x.status != SequenceStatus.RUNNING])

    run_all(s, check=check)
    assert preempted and preempted[0] == [b]
    assert s.num_preemptions >= 1
    assert a.num_output_tokens == b.num_output_tokens == 12


def test_swap_preemption_round_trip():
    s = make_scheduler(budget=64, blocks=6, block_size=4, host=16, mode="swap")
    a = add(s, 0, 8, max_tokens=12)
    b = add(s, 1, 8, max_tokens=12)
    swaps = {"out": 0, "in": 0}

    def check(out):
        swaps["out"] += len(out.blocks_to_swap_out)
        swaps["in"] += len(out.blocks_to_swap_in)

    run_all(s, check=check)
    assert swaps["out"] > 0 and swaps["in"] > 0
    assert a.num_output_tokens == b.num_output_tokens == 12


def test_request_that_can_never_fit_is_rejected_not_queued_forever():
    s = make_scheduler(budget=64, blocks=4, block_size=4)
    too_big = add(s, 0, 10, max_tokens=20)  # needs 8 blocks
    ok = add(s, 1, 4, max_tokens=4)
    out = step(s)
    assert too_big.status == SequenceStatus.FINISHED_ERROR and s.take_reported() == [too_big.group]
    assert "needs up to 8 KV-cache blocks" in too_big.group.error
    assert [x.seq for x in out.scheduled] == [ok]
    run_all(s)


def test_prompts_owed_log_probs_share_the_steps_rows():
    """`prompt_logprob_rows` (the platform's bound on a step's logits for prompt log-probs):
    prompts owed log-probs get 6 tokens a step, all together; a plain prompt takes the rest of
    the budget; once a prompt's log-probs are all in, its decodes are not counted."""
    s = make_scheduler(budget=16, rows=6)
    a = add(s, 0, 10, max_tokens=3, prompt_logprobs=1)
    b = add(s, 1, 9, max_tokens=3, prompt_logprobs=0)
    add(s, 2, 20, max_tokens=3)  # plain
    sizes = []
    while s.num_unfinished:
        out = step(s)
        sizes.append({x.seq.seq_id: x.num_new_tokens for x in out.scheduled})
        owed = sum(x.num_new_tokens for x in out.scheduled if x.seq.group.params.prompt_logprobs is not None
                   and x.seq.num_computed_tokens - x.num_new_tokens < x.seq.num_prompt_tokens)
        assert owed <= 6
    # a takes the step's 6 rows; b, and c behind it, wait (arrival order) until rows are left;
    # a decodes uncounted while b takes 6 rows and c the rest of the budget
    assert sizes == [{0: 6}, {0: 4, 1: 2, 2: 10}, {0: 1, 1: 6, 2: 9}, {0: 1, 1: 1, 2: 1},
                     {1: 1, 2: 1}, {1: 1, 2: 1}]
    for group in (a.group, b.group):
        assert len(group.prompt_logprobs) == len(group.prompt_token_ids)


def test_without_chunked_prefill_prompt_log_probs_are_not_bounded():
    s = make_scheduler(budget=32, rows=6, chunked=False, max_len=32)
    add(s, 0, 20, prompt_logprobs=1)
    assert step(s).scheduled[0].num_new_tokens == 20


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_with_prompt_log_probs_obey_the_rows(seed):
    rng = random.Random(seed)
    rows = rng.choice([1, 5, 9])
    s = make_scheduler(budget=24, max_seqs=5, blocks=20, block_size=4, host=20,
                       mode=rng.choice(["recompute", "swap"]), max_len=24, rows=rows)

    def check(out):
        owed = [x for x in out.scheduled if x.seq.group.wants_prompt_logprobs]
        assert sum(x.num_new_tokens for x in owed) <= rows

    seq_id = 0
    for _ in range(60):
        for _ in range(rng.randrange(3)):
            n = rng.randrange(1, 16)
            extra = {"prompt_logprobs": 1} if rng.random() < 0.5 else {}
            add(s, seq_id, n, max_tokens=rng.randrange(1, 24 - n + 1), **extra)
            seq_id += 1
        if s.num_unfinished:
            step(s, check)
    run_all(s, check=check)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("chunked", [True, False])
def test_random_workloads_obey_the_rules(seed, chunked):
    rng = random.Random(seed)
    s = make_scheduler(budget=24, max_seqs=5, blocks=20, chunked=chunked, block_size=4,
                       host=20, mode=rng.choice(["recompute", "swap"]), caching=rng.random() < 0.5,
                       max_len=24)
    seq_id = 0
    for _ in range(60):
        for _ in range(rng.randrange(3)):
            n = rng.randrange(1, 16)
            add(s, seq_id, n, max_tokens=rng.randrange(1, 24 - n + 1))
            seq_id += 1
        if s.num_unfinished:
            step(s)
    run_all(s)


def test_the_plain_data_tells_the_workers_what_they_hold():
    """A sequence is described in full once (new_seqs), again after a preemption (what the
    workers held for it is stale), and forgotten when it finishes; the tokens it generated go
    along every step only if its sampling reads them (penalties, min_tokens)."""
    s = make_scheduler(budget=64)
    add(s, 0, 3, max_tokens=12)
    group = SequenceGroup("r1", None, [4, 5, 6], SamplingParams(repetition_penalty=1.2), max_tokens=2)
    reads = s.add_request(group)
    first = step(s).plain
    assert [n.seq_id for n in first.new_seqs] == [0, 1] and first.new_seqs[1].params is group.params
    assert first.token_history == {1: reads.token_ids}
    second = step(s).plain  # both decode
    assert second.new_seqs == [] and second.token_history == {1: reads.token_ids}
    assert reads.is_finished and step(s).plain.finished_seq_ids == [1]
    run_all(s)

    s = make_scheduler(budget=64, blocks=6, block_size=4)  # b is preempted (see above)
    a, b = add(s, 0, 8, max_tokens=12), add(s, 1, 8, max_tokens=12)
    sent, was_preempted = [], False
    while s.num_unfinished:
        out = step(s)
        was_preempted = was_preempted or b.num_preemptions > 0
        sent += [(n.seq_id, was_preempted) for n in out.plain.new_seqs]
    assert (1, False) in sent and (1, True) in sent  # b: once new, once back after preemption
    assert a.num_preemptions == 0 and [x for x in sent if x[0] == 0] == [(0, False)]


def test_finished_ids_wait_for_a_schedule_the_workers_see():
    """Sequences aborted while nothing else runs: the empty schedules that follow never reach the
    workers, so the ids wait for the next one that does."""
    s = make_scheduler()
    seq = add(s, 0, 3)
    step(s)
    s.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert s.schedule().is_empty and s.schedule().finished_seq_ids == []
    add(s, 1, 3)
    assert s.schedule().finished_seq_ids == [0]
