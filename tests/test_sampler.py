"""The sampler alone: distributions (statistical tests with a fixed seed), penalties, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omniinfer.sampling import processing
from omniinfer.sampling import sampler as sampler_module
from omniinfer.sampling.metadata import PromptLogprobRows, SamplingMetadata, SeqState
from omniinfer.sampling.params import SamplingParams
from omniinfer.sampling.processing import SampleRow, apply_penalties, inverse_cdf
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


def _penalised_densely(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The reference: vLLM's formulas over every token of every row."""
    counts = torch.zeros_like(logits)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    rep, freq, pres = (torch.ones(len(rows), 1), torch.zeros(len(rows), 1), torch.zeros(len(rows), 1))
    for i, row in enumerate(rows):
        p = row.params
        for t in row.seq.output_token_ids + list(row.extra):
            counts[i, t] += 1
        if p.repetition_penalty != 1:
            seen[i, row.seq.prompt_token_ids] = True
        rep[i], freq[i], pres[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
    seen |= counts > 0
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - freq * counts - pres * (counts > 0).float()


def test_penalties_of_many_rows_equal_the_dense_formulas():
    """Rows with each penalty alone, all of them, none, proposed tokens (`extra`), repeated and
    shared tokens: bit for bit what the formulas give over the whole vocabulary."""
    g = torch.Generator().manual_seed(0)
    vocab = 500
    kinds = [dict(repetition_penalty=1.3), dict(frequency_penalty=0.4), dict(presence_penalty=-0.6),
             dict(repetition_penalty=0.8, frequency_penalty=-0.2, presence_penalty=0.5), {},
             dict(repetition_penalty=1.1)]
    rows_ = []
    for i, kind in enumerate(kinds):
        md = rows(SamplingParams(temperature=1.0, **kind), 1,
                  outputs=torch.randint(0, 40, (30,), generator=g).tolist(), first_id=i)
        md.seqs[0].prompt_token_ids = torch.randint(20, vocab, (50,), generator=g).tolist()
        md.seqs[0].token_ids = md.seqs[0].prompt_token_ids + md.seqs[0].token_ids[2:]
        rows_.append(SampleRow(md.seqs[0], 0, extra=(3, 3, 499) if i % 2 else ()))
    logits = torch.randn(len(kinds), vocab, generator=g) * 3
    before = logits.clone()
    got = apply_penalties(logits, rows_)
    assert torch.equal(got, _penalised_densely(logits, rows_))
    assert not torch.equal(got[:4], logits[:4]) and torch.equal(got[4], logits[4])
    assert torch.equal(logits, before)  # the caller's logits are left alone
    # a request's first token: its prompt alone is penalised; with no repetition penalty, nothing
    for kind in (dict(repetition_penalty=1.3), dict(frequency_penalty=0.4)):
        first = rows(SamplingParams(temperature=1.0, **kind), 1).seqs[0]
        row = [SampleRow(first, 0)]
        assert torch.equal(apply_penalties(logits[:1], row), _penalised_densely(logits[:1], row))


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


@pytest.mark.parametrize("dtype,k", [(torch.float32, 4), (torch.bfloat16, 4), (torch.float32, 1)])
def test_logprob_table_a_few_rows_at_a_time_equals_the_whole_tensor_ops(dtype, k, monkeypatch):
    """log_softmax, the chosen token's log-prob, its rank and the top k, taken 5 rows at a time
    (the chunk forced small), equal the whole-tensor ops bit for bit; log_softmax never sees more
    than 5 rows. Ties (rounded logits) make the ranks and the top k's order matter; the top 1 is
    the first of the row's best (an argmax, not topk)."""
    vocab = 1000
    monkeypatch.setattr(sampler_module, "_LOGPROB_CHUNK_BYTES", 5 * 4 * vocab)
    seen = []
    log_softmax = torch.log_softmax
    monkeypatch.setattr(torch, "log_softmax",
                        lambda x, *args, **kwargs: seen.append(x.shape[0]) or log_softmax(x, *args, **kwargs))
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(37, vocab, generator=g) * 4).round(decimals=1).to(dtype)
    ids = torch.randint(0, vocab, (37,), generator=g)
    ids[:3] = logits[:3].float().argmax(dim=-1)  # rank 1
    chosen, ranks, top_vals, top_ids = sampler_module.logprob_table(logits, ids, k)
    assert seen == [5] * 7 + [2]
    whole = log_softmax(logits.float(), dim=-1)
    picked = whole.gather(1, ids[:, None])
    assert chosen == picked[:, 0].tolist()
    assert ranks == ((whole > picked).sum(dim=1) + 1).tolist()
    assert ranks[:3] == [1, 1, 1] and max(ranks) > 100
    if k == 1:
        first_best = whole.numpy().argmax(axis=-1)
        assert top_ids == [[int(t)] for t in first_best]
        assert top_vals == whole.amax(dim=-1, keepdim=True).tolist()
        assert (whole == whole.amax(dim=-1, keepdim=True)).sum(dim=-1).max() > 1  # a tie was met
    else:
        top = whole.topk(k, dim=-1)
        assert top_vals == top.values.tolist() and top_ids == top.indices.tolist()
    # already log-probs: taken as they are; no rows: nothing
    assert sampler_module.logprob_table(whole, ids, 0, normalise=False)[:2] == (chosen, ranks)
    assert sampler_module.logprob_table(logits[:0], ids[:0], 3) == ([], [], [], [])


def test_prompt_logprobs_of_many_rows_equal_those_of_one_log_softmax(monkeypatch):
    """A prompt's log-prob rows through the Sampler, 3 rows a chunk: every entry (the prompt
    token's log-prob and rank, and the top 2) is what one whole log_softmax gives."""
    vocab = 64
    monkeypatch.setattr(sampler_module, "_LOGPROB_CHUNK_BYTES", 3 * 4 * vocab)
    logits = torch.randn(12, vocab, generator=torch.Generator().manual_seed(1)) * 3
    targets = list(range(5, 16))  # rows 1..11 predict these
    md = rows(SamplingParams(temperature=0, prompt_logprobs=2), 1)
    md.prompt_rows.append(PromptLogprobRows(md.seqs[0], 1, targets, 1))
    out, _ = Sampler(vocab)(logits, md)
    first, entries = out.prompt_logprobs[0]
    ref = torch.log_softmax(logits[1:], dim=-1)
    assert first == 1 and len(entries) == len(targets)
    for i, (tid, entry) in enumerate(zip(targets, entries)):
        assert entry[tid].logprob == ref[i, tid].item()
        assert entry[tid].rank == int((ref[i] > ref[i, tid]).sum()) + 1
        best = ref[i].topk(2)
        for r, (value, token) in enumerate(zip(best.values.tolist(), best.indices.tolist())):
            if token != tid:
                assert entry[token].logprob == value and entry[token].rank == r + 1
        assert len(entry) == 2 + (tid not in best.indices.tolist())


def test_fork_row_draws_n_independent_samples():
    sampler = Sampler(VOCAB, torch.Generator().manual_seed(0))
    md = rows(SamplingParams(temperature=1.0, n=4, seed=3), 1)
    md.num_samples = [4]
    new, _ = sample(sampler, LOGITS[None], md)
    assert len(new[0]) == 4
    again = rows(SamplingParams(temperature=1.0, n=4, seed=3), 1)
    again.num_samples = [4]
    assert sample(Sampler(VOCAB), LOGITS[None], again)[0][0] == new[0]  # seeded: reproducible


# ---- at the size of a real vocabulary: top-k / top-p among candidates, the two-step draw ----------

def _kept_by_a_whole_sort(row: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The reference, in float64: sort the row, keep its top_k, then the fewest best tokens whose
    mass over the kept top-k reaches top_p. Returns the kept mask and, per token, the mass of the
    tokens ranked before it (where the top-p cut falls)."""
    order = np.argsort(-row, kind="stable")
    kept = np.zeros(row.size, dtype=bool)
    kept[order[:top_k]] = True
    probs = np.exp(row[order[:top_k]] - row[order[:top_k]].max())
    probs /= probs.sum()
    cum_before = np.full(row.size, np.inf)
    cum_before[order[:top_k]] = np.cumsum(probs) - probs
    if top_p < 1:
        kept &= cum_before < top_p
        kept[order[0]] = True
    return kept, cum_before


@pytest.mark.parametrize("batch", [[0, 1, 2, 3], [3, 2, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8], [8, 4, 6, 5]],
                         ids=["top-p-alone", "wide-ones", "mixed", "top-k-alone"])
def test_top_k_top_p_keeps_what_a_whole_sort_keeps(batch, monkeypatch):
    """Rows whose top-p set lies within each list of candidates (64, 4096, 32768) or none (the
    whole row sorted), rows with a top-k wider than the first lists, and rows that keep
    everything: each keeps what sorting its whole row keeps, with its own logits, whatever else is
    in the batch, and is settled by the first list that holds its answer."""
    vocab = 40000
    g = torch.Generator().manual_seed(0)
    scales = [12.0, 3.0, 1.5, 0.2, 1.0, 1.0, 3.0, 1.0, 0.2]
    top_k = [vocab, vocab, vocab, vocab, 40, 5000, 100, vocab, 8000]
    top_p = [0.9, 0.9, 0.9, 0.9, 1.0, 1.0, 0.8, 1.0, 0.99]
    logits = (torch.randn(len(scales), vocab, generator=g) * torch.tensor(scales)[:, None])[batch]
    settled_at = {}  # row -> how many of its best tokens settled it
    real = processing._keep_among_best

    def spy(logits, out, rows, count, k_all, p_all):
        settled, mass, least = real(logits, out, rows, count, k_all, p_all)
        settled_at.update((batch[r], count) for r in rows[settled].tolist())
        return settled, mass, least

    monkeypatch.setattr(processing, "_keep_among_best", spy)
    out = processing._top_k_top_p(logits, [top_k[i] for i in batch], [top_p[i] for i in batch])
    sizes = {}
    for row, i in enumerate(batch):
        want, cum_before = _kept_by_a_whole_sort(logits[row].double().numpy(), top_k[i], top_p[i])
        got = torch.isfinite(out[row]).numpy()
        # only a token whose mass before it lies within float32's reach of top_p may differ
        differ = got != want
        assert not (differ & (np.abs(cum_before - top_p[i]) > 1e-5)).any(), f"row {i}: {got.sum()} kept, not {want.sum()}"
        assert torch.equal(out[row][got], logits[row][got])
        sizes[i] = int(want.sum())
    # by top-p alone, each row's set fits the list that settled it and not the one before; a top-k
    # settles in the first list that holds it; the row that keeps everything is never looked at
    fits = {0: (0, 64), 1: (64, 4096), 2: (4096, 32768), 3: (32768, vocab)}  # (the rows are what they say)
    assert all(fits[i][0] < sizes[i] <= fits[i][1] for i in batch if i in fits), sizes
    settles = {0: 64, 1: 4096, 2: 32768, 3: vocab, 4: 64, 5: 32768, 6: 4096, 8: 32768}
    if all(top_k[i] < vocab for i in batch):  # rows that all have a top-k: among their widest
        settles.update({4: 40, 6: 100, 5: 8000, 8: 8000})
    assert settled_at == {i: settles[i] for i in batch if i in settles}
    assert sizes.get(7, vocab) == vocab


def test_a_flat_row_goes_from_its_first_candidates_to_the_sort(monkeypatch):
    """A row of a real vocabulary so flat that its top-p set holds most of it: once its 64 best
    show that 4096 or 32768 could not hold the set (none of the rest is likelier than the 64th),
    it is sorted at once, not looked at among those first. Its answer is the sort's."""
    vocab = 151936
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 0.2
    looked = []
    real = processing._keep_among_best

    def spy(logits, out, rows, count, k_all, p_all):
        looked.append(count)
        return real(logits, out, rows, count, k_all, p_all)

    monkeypatch.setattr(processing, "_keep_among_best", spy)
    out = processing._top_k_top_p(logits, [vocab], [0.9])
    assert looked == [64, vocab]
    want, cum_before = _kept_by_a_whole_sort(logits[0].double().numpy(), vocab, 0.9)
    differ = torch.isfinite(out[0]).numpy() != want
    assert want.sum() > 32768 and not (differ & (np.abs(cum_before - 0.9) > 1e-5)).any()


def _first_past(probs: np.ndarray, u: float) -> int:
    """The reference draw: the first token whose float64 running mass exceeds u * the mass, at most
    the last token of nonzero probability; 0 for a row of zeros."""
    running = np.cumsum(probs.astype(np.float64))
    if running[-1] == 0:
        return 0
    return min(int(np.searchsorted(running, u * running[-1], side="right")), int(np.flatnonzero(probs)[-1]))


@pytest.mark.parametrize("vocab", [1, 7, 1024, 1025, 3000, 5120])
def test_inverse_cdf_takes_the_first_token_past_u(vocab):
    g = torch.Generator().manual_seed(vocab)
    probs = torch.softmax(torch.randn(6, vocab, generator=g) * 3, dim=-1)
    probs[1, ::3] = 0  # zeros, at chunk edges too
    probs[2, vocab // 2:] = 0  # the last chunks hold no mass
    probs[3, :] = 0
    probs[3, -1] = 0.25  # only the last token
    probs[4] *= 1e-30  # unnormalised, tiny
    probs[5] = 0  # nothing at all: token 0
    for u in (0.0, 0.5, 1 - 2.0 ** -53, *torch.rand(8, generator=g, dtype=torch.float64).tolist()):
        got = inverse_cdf(probs, torch.full((6,), u, dtype=torch.float64)).tolist()
        want = [_first_past(probs[i].numpy(), u) for i in range(6)]
        assert got == want, (u, got, want)
        # never a token of zero probability (from a row with any mass)
        assert all(probs[i, t] > 0 for i, t in enumerate(got) if probs[i].sum() > 0)


def test_random_sampling_matches_softmax_across_chunks():
    """The two-step draw picks the right chunk and the right token in it: the mass sits on the
    tokens either side of each 1024-token edge and in the short last chunk."""
    vocab = 2100
    hot = torch.tensor([0, 1023, 1024, 2047, 2048, 2099, 1500, 5])
    logits = torch.full((vocab,), float("-inf"))
    logits[hot] = LOGITS
    sampler = Sampler(vocab, torch.Generator().manual_seed(0))
    counts = torch.zeros(vocab)
    for _ in range(4):
        new, _ = sample(sampler, logits.repeat(5000, 1), rows(SamplingParams(temperature=1.0), 5000))
        counts += torch.bincount(torch.tensor([t[0] for t in new.values()]), minlength=vocab).float()
    assert counts.sum() == counts[hot].sum()  # nothing outside the hot tokens
    assert chi_square(counts[hot], torch.softmax(LOGITS, 0)) < CHI2_CRITICAL_DF7
