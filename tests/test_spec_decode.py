"""Speculative decoding: exact outputs, exact distributions, and the multi-step draft runner."""

from __future__ import annotations

import json
import random

import pytest
import torch

from omniinfer import LLM, SamplingParams
from omniinfer.sampling.metadata import SeqState
from omniinfer.sampling.processing import SampleRow
from omniinfer.sampling.rejection import rejection_sample
from omniinfer.step import NewSeq
from omniinfer.testing.tiny_models import build_tiny_checkpoint

# chi-square critical value at p = 0.001 for 5 degrees of freedom (6 categories)
CHI2_CRITICAL_DF5 = 20.52


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller sibling of the tiny llama (same tokenizer): 1 layer, different weights."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("draft") / "d"), "llama",
                                 num_hidden_layers=1, seed=1)


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(n)]} for n in lengths]


def greedy_tokens(llm, prompts, max_tokens=20):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def baseline(checkpoint_dir):
    cache = {}

    def get(lengths):
        key = tuple(lengths)
        if key not in cache:
            llm = LLM(checkpoint_dir("llama"), num_kv_blocks=256, block_size=8)
            cache[key] = greedy_tokens(llm, prompts_of(lengths))
        return cache[key]

    return get


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_identical_to_no_speculation(k, checkpoint_dir, draft_dir, baseline):
    lengths = [5, 17, 30, 9, 1, 12, 23, 8, 15, 3, 26, 11, 7, 19, 2, 16][: 4 * k]  # 4 to 16 requests
    llm = LLM(checkpoint_dir("llama"), num_kv_blocks=256, block_size=8, speculative_model=draft_dir,
              num_speculative_tokens=k)
    assert greedy_tokens(llm, prompts_of(lengths)) == baseline(lengths)
    stats = llm.llm_engine.stats()
    assert stats["num_spec_proposed_tokens"] > 0
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]


@pytest.mark.parametrize("batch", [1, 16])
def test_with_chunked_prefill_and_preemption(batch, checkpoint_dir, draft_dir, baseline):
    lengths = [5, 17, 30, 9, 1, 12, 23, 8, 15, 3, 26, 11, 7, 19, 2, 16][:batch]
    llm = LLM(checkpoint_dir("llama"), block_size=8, num_kv_blocks=12 if batch > 1 else 16,
              max_num_batched_tokens=16, max_num_seqs=8, speculative_model=draft_dir,
              num_speculative_tokens=3)
    assert greedy_tokens(llm, prompts_of(lengths)) == baseline(lengths)
    if batch > 1:
        assert llm.llm_engine.stats()["num_preemptions"] > 0


def test_draft_equal_to_target_accepts_everything(checkpoint_dir, baseline):
    path = checkpoint_dir("llama")
    llm = LLM(path, num_kv_blocks=128, block_size=8, speculative_model=path, num_speculative_tokens=4)
    draft, drafted = llm.llm_engine.executor.worker.proposer.runner.model, []
    compute = draft.compute_greedy_tokens
    draft.compute_greedy_tokens = lambda hidden, argmax: drafted.append(len(hidden)) or compute(hidden, argmax)
    assert greedy_tokens(llm, prompts_of([6, 14])) == baseline([6, 14])
    assert drafted  # greedy drafts straight from the draft's LM head: the target's own tokens
    stats = llm.llm_engine.stats()
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["num_spec_emitted_tokens"] == stats["num_spec_accepted_tokens"] + stats["num_spec_draft_steps"] * 2


def test_random_and_greedy_requests_in_one_batch(checkpoint_dir, draft_dir, baseline):
    path = checkpoint_dir("llama")
    prompts = prompts_of([6, 14, 9, 21])
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=6, max_tokens=20, ignore_eos=True,
                             presence_penalty=0.5)]
    runs = []
    for _ in range(2):
        llm = LLM(path, num_kv_blocks=128, block_size=8, speculative_model=draft_dir,
                  num_speculative_tokens=3)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]  # seeded: deterministic
    expected = baseline([6, 14, 9, 21])
    assert runs[0][0] == expected[0] and runs[0][2] == expected[2]


def test_multi_step_draft_equals_single_steps_across_a_block_boundary(checkpoint_dir):
    """k passes advanced in place give the tokens of k separately built single steps."""
    path = checkpoint_dir("llama")
    llm = LLM(path, num_kv_blocks=64, block_size=8, speculative_model=path, num_speculative_tokens=5)
    proposer = llm.llm_engine.executor.worker.proposer
    runner, caches = proposer.runner, proposer.cache.device_cache
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]]
    tables = [[1, 2], [3, 4, 5]]  # positions 6..10 and 13..17 cross into the next block
    rows = []
    for i, p in enumerate(prompts):
        rows.append(SampleRow(_state(i, p, SamplingParams(temperature=0)), 0))
    first = runner.first_pass_input(prompts, [0, 0], tables)
    multi, _ = runner.propose(first, rows, 5, caches, None)
    for cache in caches:
        cache.zero_()
    single = []
    seqs = [list(p) for p in prompts]
    for _ in range(5):
        step = runner.first_pass_input(seqs, [0, 0], tables)
        tokens, _ = runner.propose(step, rows, 1, caches, None)
        for s, t in zip(seqs, tokens[:, 0].tolist()):
            s.append(t)
        single.append(tokens[:, 0])
    assert torch.equal(multi, torch.stack(single, dim=1))


def _state(seq_id, prompt, params) -> SeqState:
    """A sequence as the driver worker's sampling sees it."""
    return SeqState(NewSeq(seq_id, f"r{seq_id}", 0, params, list(prompt), []), {})


def _rows(n):
    return [SampleRow(_state(i, [1], SamplingParams(temperature=1.0)), 0) for i in range(n)]


def chi_square(counts, probs):
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "emitted a token the target gives zero probability"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


P = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.00],
                  [0.05, 0.10, 0.40, 0.05, 0.20, 0.20],
                  [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]])


@pytest.mark.parametrize("q_kind", ["different", "all_rejected", "equal"])
def test_rejection_sampler_keeps_the_target_distribution(q_kind):
    """Each emitted position follows the target's distribution (given the tokens before it)."""
    n, k = 30000, 2
    if q_kind == "different":
        q = torch.tensor([[0.05, 0.05, 0.10, 0.30, 0.30, 0.20], [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])
    elif q_kind == "all_rejected":  # drafts only ever propose token 5, which p[0] forbids
        q = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    else:
        q = P[:k].clone()
    g = torch.Generator().manual_seed(0)
    drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
    result = rejection_sample(P.expand(n, -1, -1), drafts, q.expand(n, -1, -1), _rows(n),
                              torch.Generator().manual_seed(1))
    first = torch.tensor([t[0] for t in result.tokens])
    assert chi_square(torch.bincount(first, minlength=6).float(), P[0]) < CHI2_CRITICAL_DF5
    if q_kind == "all_rejected":
        assert set(result.num_accepted) == {0}
    # position 1 (given position 0 was accepted) follows P[1]
    second = torch.tensor([t[1] for t in result.tokens if len(t) > 1])
    if q_kind != "all_rejected":
        assert chi_square(torch.bincount(second, minlength=6).float(), P[1]) < CHI2_CRITICAL_DF5
    if q_kind == "equal":
        assert set(result.num_accepted) == {2}
        bonus = torch.tensor([t[2] for t in result.tokens])  # all accepted: the bonus follows P[2]
        assert chi_square(torch.bincount(bonus, minlength=6).float(), P[2]) < CHI2_CRITICAL_DF5


def test_greedy_rows_reduce_to_prefix_matching():
    p = torch.nn.functional.one_hot(torch.tensor([[2, 4, 1]]), 6).float()
    q = torch.nn.functional.one_hot(torch.tensor([[2, 3]]), 6).float()
    result = rejection_sample(p, torch.tensor([[2, 3]]), q, _rows(1))
    assert result.num_accepted == [1] and result.tokens == [[2, 4]]
    q = torch.nn.functional.one_hot(torch.tensor([[2, 4]]), 6).float()
    result = rejection_sample(p, torch.tensor([[2, 4]]), q, _rows(1))
    assert result.num_accepted == [2] and result.tokens == [[2, 4, 1]]


def test_configuration_errors(checkpoint_dir, draft_dir, tmp_path):
    path = checkpoint_dir("llama")
    with pytest.raises(ValueError, match="give both or neither"):
        LLM(path, speculative_model=draft_dir)
    with pytest.raises(ValueError, match="num_speculative_tokens=0"):
        LLM(path, speculative_model=draft_dir, num_speculative_tokens=0)
    other = build_tiny_checkpoint(str(tmp_path / "other"), "llama", vocab_size=500)
    with pytest.raises(ValueError, match="vocab_size=500 but the target model has 384"):
        LLM(path, speculative_model=other, num_speculative_tokens=2)


def test_allowed_tokens_and_bad_words_under_speculation(checkpoint_dir, draft_dir):
    """The draft proposes from unmasked logits; the target's check masks the allowed set and
    the bad words (their history including the proposals before each position), so the
    tokens are those of decoding without speculation."""
    from transformers import AutoTokenizer

    path = checkpoint_dir("llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    allowed = list(range(40, 80))
    word = tokenizer.decode([50, 51])
    assert tokenizer(word, add_special_tokens=False).input_ids == [50, 51]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed,
                             bad_words=[word, tokenizer.decode([60])]),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words=[word])]
    prompts = prompts_of([5, 17])
    plain = LLM(path, num_kv_blocks=128, block_size=8).generate(prompts, params, use_tqdm=False)
    for draft in (draft_dir, path):
        llm = LLM(path, num_kv_blocks=128, block_size=8, speculative_model=draft, num_speculative_tokens=3)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
        assert llm.llm_engine.stats()["num_spec_proposed_tokens"] > 0
    first = plain[0].outputs[0].token_ids
    assert set(first) <= set(allowed) and 60 not in first
    assert not any(first[i:i + 2] == [50, 51] for i in range(len(first)))


@pytest.mark.parametrize("extra", [dict(logprobs=2), dict(repetition_penalty=1.3), dict(logit_bias={97: 3.0}),
                                   dict(min_tokens=12, stop_token_ids=[268])])
def test_greedy_requests_that_are_not_plain_argmax_under_speculation(extra, checkpoint_dir, draft_dir):
    """Greedy with log-probs, a penalty, a logit bias or min_tokens: the draft proposes without
    distributions (every request greedy), and the check failed each such request
    ("expected Tensor ... got NoneType"). Now it matches the argmax of the processed logits,
    each position with its own history; tokens and log-probs as without speculation."""
    path = checkpoint_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **extra)
    prompts = prompts_of([5, 17, 9])
    plain = LLM(path, num_kv_blocks=128, block_size=8).generate(prompts, params, use_tqdm=False)
    for draft in (draft_dir, path):  # (the target as its own draft: most proposals accepted)
        llm = LLM(path, num_kv_blocks=128, block_size=8, speculative_model=draft, num_speculative_tokens=3)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
        if params.logprobs:
            for o, ref in zip(outs, plain):
                assert [{t: pytest.approx(lp.logprob, abs=1e-4) for t, lp in step.items()}
                        for step in o.outputs[0].logprobs] == \
                    [{t: lp.logprob for t, lp in step.items()} for step in ref.outputs[0].logprobs]
        assert llm.llm_engine.stats()["num_spec_proposed_tokens"] > 0
    assert llm.llm_engine.stats()["num_spec_accepted_tokens"] > 0


def test_vllms_speculative_config_spelling(checkpoint_dir, draft_dir, baseline):
    """vLLM (0.9+) takes the draft as speculative_config={"model", "num_speculative_tokens"}
    (`--speculative-config '{...}'`); the old flags are what this engine had."""
    from omniinfer.entrypoints.cli import build_parser
    from omniinfer.entrypoints.engine_flags import engine_kwargs

    path = checkpoint_dir("llama")
    config = {"model": draft_dir, "num_speculative_tokens": 3, "method": "draft_model"}
    llm = LLM(path, num_kv_blocks=128, block_size=8, speculative_config=config)
    assert llm.llm_engine.config.speculative.num_speculative_tokens == 3
    assert llm.llm_engine.config.scheduler.num_scheduler_steps == 1  # (not the offline 8)
    assert greedy_tokens(llm, prompts_of([6, 14])) == baseline([6, 14])
    assert llm.llm_engine.stats()["num_spec_proposed_tokens"] > 0
    args = build_parser().parse_args(["serve", path, "--speculative-config", json.dumps(config)])
    assert engine_kwargs(args)["speculative_config"] == config


@pytest.mark.parametrize("config, error, match", [
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, ValueError,
     r"speculative_config holds 'prompt_lookup_max'; allowed keys: model, num_speculative_tokens"),
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 3}, ValueError,
     "speculative_config method='eagle' is not supported; the one method here is 'draft_model'"),
    ({"model": "DRAFT"}, ValueError, "num_speculative_tokens=None: give both or neither"),
    ({"model": "DRAFT", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, ValueError,
     "draft_tensor_parallel_size=2 is not supported"),
    ("DRAFT", TypeError, "speculative_config must be a dict"),
])
def test_speculative_config_errors(config, error, match, checkpoint_dir, draft_dir):
    config = {k: draft_dir if v == "DRAFT" else v for k, v in config.items()} if isinstance(config, dict) else config
    with pytest.raises(error, match=match):
        LLM(checkpoint_dir("llama"), speculative_config=config)
    with pytest.raises(ValueError, match="give speculative_config or speculative_model"):
        LLM(checkpoint_dir("llama"), speculative_model=draft_dir, num_speculative_tokens=2,
            speculative_config={"model": draft_dir, "num_speculative_tokens": 2})


def test_speculative_config_flag_must_be_a_json_object(capsys):
    from omniinfer.entrypoints.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--speculative-config", "[1, 2]"])
    assert "--speculative-config: expected a JSON object, got '[1, 2]'" in capsys.readouterr().err
