"""The sampler alone: distributions (statistical tests with a fixed seed), penalties, logprobs."""

from __future__ import annotations

import pytest
import torch

from omniinfer.sampling.metadata import SamplingMetadata, SeqState
from omniinfer.sampling.params import SamplingParams
from omniinfer.sampling.processing import SampleRow, apply_penalties
from omniinfer.sampling.sampler import Sampler
from omniinfer.step import NewSeq

VOCAB = 8
# chi-square critical value for 7 degrees of freedom at p = 0.001
CHI2_CRITICAL_DF7 = 24.32


def rows(params: SamplingParams, n: int, outputs=None, first_id: int = 0) -> SamplingMetadata:
    md = SamplingMetadata()
    for i in range(first_id, first_id + n):
        seq = SeqState(NewSeq(i, f"r{i}", 0, params, [1, 2], []), {})
        seq.token_ids = [1, 2] + list(outputs or [])  # the step's token history
        md.seqs.append(seq)
        md.seq_ids.append(i)
        md.num_samples.append(1)
    return md


def sample(sampler, logits, md) -> tuple[dict[int, list[int]], object]:
    """seq_id -> its new tokens, and the whole ModelRunnerOutput."""
    out, _ = sampler(logits, md)
    return dict(zip(out.seq_ids, out.token_ids)), out


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token with zero probability"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def empirical(params: SamplingParams, n: int = 20000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    sampler = Sampler(VOCAB, g)
    new, _ = sample(sampler, LOGITS.repeat(n, 1), rows(params, n))
    tokens = torch.tensor([new[i][0] for i in range(n)])
    return torch.bincount(tokens, minlength=VOCAB).float()


def test_random_sampling_matches_softmax():
    counts = empirical(SamplingParams(temperature=1.0))
    assert chi_square(counts, torch.softmax(LOGITS, 0)) < CHI2_CRITICAL_DF7


def test_temperature_matches_scaled_softmax():
    counts = empirical(SamplingParams(temperature=0.7))
    assert chi_square(counts, torch.softmax(LOGITS / 0.7, 0)) < CHI2_CRITICAL_DF7


@pytest.mark.parametrize("kwargs,keep", [
    (dict(top_k=3), 3),
    (dict(top_p=0.8), None),
    (dict(min_p=0.2), None),
])
def test_truncation_renormalises(kwargs, keep):
    probs = torch.softmax(LOGITS, 0)
    if "top_p" in kwargs:  # smallest prefix whose mass reaches top_p
        keep = int((torch.cumsum(probs, 0) - probs < kwargs["top_p"]).sum())
    if "min_p" in kwargs:
        keep = int((probs >= kwargs["min_p"] * probs.max()).sum())
    target = torch.zeros(VOCAB)
    target[:keep] = probs[:keep] / probs[:keep].sum()
    counts = empirical(SamplingParams(temperature=1.0, **kwargs))
    assert counts[keep:].sum() == 0
    assert chi_square(counts, target) < CHI2_CRITICAL_DF7


def test_greedy_and_seeded_rows_in_one_batch():
    sampler = Sampler(VOCAB, torch.Generator().manual_seed(0))
    md = rows(SamplingParams(temperature=0), 2)
    seeded = rows(SamplingParams(temperature=1.0, seed=7), 1, first_id=2)
    md.seqs += seeded.seqs
    md.seq_ids += seeded.seq_ids
    md.num_samples += [1]
    new, _ = sample(sampler, LOGITS.repeat(3, 1), md)
    assert new[0] == [0] and new[1] == [0]
    # the seeded row gives the same token whatever sits next to it
    alone, _ = sample(Sampler(VOCAB, torch.Generator().manual_seed(99)), LOGITS[None],
                      rows(SamplingParams(temperature=1.0, seed=7), 1))
    assert alone[0] == new[seeded.seqs[0].seq_id]


def test_penalties():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 0.0, 0.0, 0.0, 0.0]])
    # outputs: token 2 twice, token 3 once; prompt holds 1 and 2
    md = rows(SamplingParams(temperature=0, repetition_penalty=2.0), 1, outputs=[2, 2, 3])
    processed = apply_penalties(logits.clone(), [SampleRow(md.seqs[0], 0)])
    assert processed[0].tolist() == [1.0, -2.0, 1.0, 0.25, 0.0, 0.0, 0.0, 0.0]
    md = rows(SamplingParams(temperature=0, frequency_penalty=0.5, presence_penalty=0.25), 1,
              outputs=[2, 2, 3])
    processed = apply_penalties(logits.clone(), [SampleRow(md.seqs[0], 0)])
    assert processed[0].tolist() == [1.0, -1.0, 2.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 0.0, 0.0, 0.0, 0.0]


def test_min_tokens_bans_eos_until_reached():
    sampler = Sampler(VOCAB)
    md = rows(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]), 1)
    md.seqs[0].eos_token_ids = [0]
    logits = LOGITS[None].clone()
    new, _ = sample(sampler, logits, md)
    assert new[0] == [2]  # 0 (EOS) and 1 (stop id) are banned
    assert torch.equal(logits, LOGITS[None])  # the caller's logits are left alone


def test_logprobs_are_raw_and_ranked():
    sampler = Sampler(VOCAB)
    new, out = sample(sampler, LOGITS[None],
                      rows(SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.5), 1))
    ref = torch.log_softmax(LOGITS, 0)
    assert new[0] == [0]
    assert abs(out.logprobs[0][0] - ref[0].item()) < 1e-6
    entry = out.top_logprobs[0][0]
    assert set(entry) == {0, 1} and entry[1].rank == 2
    assert abs(entry[1].logprob - ref[1].item()) < 1e-6


def test_fork_row_draws_n_independent_samples():
    sampler = Sampler(VOCAB, torch.Generator().manual_seed(0))
    md = rows(SamplingParams(temperature=1.0, n=4, seed=3), 1)
    md.num_samples = [4]
    new, _ = sample(sampler, LOGITS[None], md)
    assert len(new[0]) == 4
    again = rows(SamplingParams(temperature=1.0, n=4, seed=3), 1)
    again.num_samples = [4]
    assert sample(Sampler(VOCAB), LOGITS[None], again)[0][0] == new[0]  # seeded: reproducible
