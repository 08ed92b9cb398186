"""Logits -> the distribution a request samples from, one row at a time.

Shared by the sampler and speculative decoding (which needs the same distributions for
the draft's proposals and the target's scoring). A row is one future token of one
sequence; `extra` holds tokens proposed but not yet accepted before that position, so
penalties and `min_tokens` see the row's true history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniinfer.sampling.metadata import SeqState

_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n samples


@dataclass(frozen=True, slots=True)
class SampleRow:
    seq: SeqState
    index: int  # sample index within the request (picks the seeded generator)
    extra: tuple[int, ...] = ()  # tokens before this position that are not in seq yet

    @property
    def params(self):
        return self.seq.params

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.extra)


def generator_for(row: SampleRow, device: torch.device) -> torch.Generator | None:
    """The generator of a seeded request's sample `row.index` (created on first use)."""
    seq = row.seq
    seed = seq.params.seed
    if seed is None:
        return None
    generators = seq.generators  # the request's, shared by its n samples
    if row.index not in generators:
        g = torch.Generator(device=device)
        g.manual_seed((seed + row.index * _SEED_STRIDE) % (1 << 63))
        generators[row.index] = g
    return generators[row.index]


def apply_min_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Ban EOS and stop tokens on rows that have not reached `min_tokens` (a copy if needed)."""
    vocab = logits.shape[1]
    cloned = False
    for i, row in enumerate(rows):
        p = row.params
        if p.min_tokens and row.num_output_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else row.seq.eos_token_ids)
            banned = [t for t in banned if t < vocab]
            if banned:
                if not cloned:  # never write into the caller's logits
                    logits, cloned = logits.clone(), True
                logits[i, banned] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (prompt and output), frequency and presence penalties, as vLLM defines them."""
    if not any(row.params.has_penalties for row in rows):
        return logits
    num_rows, vocab = logits.shape
    device = logits.device
    counts = torch.zeros(num_rows, vocab, device=device)
    seen_prompt = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
    rep = torch.ones(num_rows, 1, device=device)
    freq = torch.zeros(num_rows, 1, device=device)
    pres = torch.zeros(num_rows, 1, device=device)
    for i, row in enumerate(rows):
        p, seq = row.params, row.seq
        if not p.has_penalties:
            continue
        out_ids = seq.output_token_ids + list(row.extra)
        if out_ids:
            ids = torch.tensor(out_ids, device=device)
            counts[i].index_add_(0, ids, torch.ones(len(out_ids), device=device))
        if p.repetition_penalty != 1:
            seen_prompt[i, torch.tensor(seq.prompt_token_ids, device=device)] = True
        rep[i], freq[i], pres[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
    seen = seen_prompt | (counts > 0)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=device)[None, :]
    drop = ranks >= torch.tensor(top_k, device=device)[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
    drop |= cum_before >= torch.tensor(top_p, device=device)[:, None]
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def random_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p -> probabilities (rows are random-sampling rows)."""
    device, vocab = logits.device, logits.shape[1]
    params = [row.params for row in rows]
    logits = logits / torch.tensor([p.temperature for p in params], device=device)[:, None]
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(tp < 1 for tp in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = [p.min_p for p in params]
    if any(min_p):
        threshold = torch.tensor(min_p, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Add each row's `logit_bias` to its logits (a copy if any row has one)."""
    biased = [(i, row.params.logit_bias) for i, row in enumerate(rows) if row.params.logit_bias]
    if not biased:
        return logits
    logits = logits.clone()
    row_index = torch.tensor([i for i, bias in biased for _ in bias], device=logits.device)
    token_ids = torch.tensor([t for _, bias in biased for t in bias], device=logits.device)
    values = torch.tensor([v for _, bias in biased for v in bias.values()], device=logits.device,
                          dtype=logits.dtype)
    logits.index_put_((row_index, token_ids), values, accumulate=True)
    return logits


def processed(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """min-tokens masking, logit bias and penalties (vLLM's order): the logits every row's
    choice is made from."""
    return apply_penalties(apply_logit_bias(apply_min_tokens(logits.float(), rows), rows), rows)


def sampling_probs(logits: torch.Tensor, rows: list[SampleRow], history: bool = True) -> torch.Tensor:
    """The exact distribution each row samples from: one-hot argmax for greedy rows. With
    `history=False` min-tokens masking and penalties are skipped (a draft's proposals: any
    proposal distribution keeps rejection sampling exact, and this one needs no history)."""
    logits = processed(logits, rows) if history else logits.float()
    probs = torch.empty_like(logits)
    greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
    random = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if greedy:
        g = torch.tensor(greedy, device=logits.device)
        probs[g] = torch.nn.functional.one_hot(logits[g].argmax(dim=-1), logits.shape[1]).float()
    if random:
        r = torch.tensor(random, device=logits.device)
        probs[r] = random_probs(logits[r], [rows[i] for i in random])
    return probs


def _noise(shape: tuple[int, int], rows: list[SampleRow], device: torch.device,
           default: torch.Generator | None, fill: str) -> torch.Tensor:
    """Noise per row (`fill` is "exponential_" or "uniform_"), from each seeded request's own
    generator, else from `default`."""
    out = torch.empty(shape, device=device)
    unseeded = []
    for i, row in enumerate(rows):
        g = generator_for(row, device)
        if g is None:
            unseeded.append(i)
        else:
            getattr(out[i], fill)(generator=g)
    if unseeded:
        index = torch.tensor(unseeded, device=device)
        out[index] = getattr(torch.empty(len(unseeded), shape[1], device=device), fill)(generator=default)
    return out


def exponentials(shape: tuple[int, int], rows: list[SampleRow], device: torch.device,
                 default: torch.Generator | None) -> torch.Tensor:
    """Exp(1) noise per row."""
    return _noise(shape, rows, device, default, "exponential_")


def draw(probs: torch.Tensor, rows: list[SampleRow], default: torch.Generator | None) -> torch.Tensor:
    """One exact draw per row: argmax(probs / Exp(1)) (the exponential race). Greedy rows
    (one-hot probs) take their argmax without drawing noise."""
    random = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if len(random) == len(rows):
        return (probs / exponentials(tuple(probs.shape), rows, probs.device, default)).argmax(dim=-1)
    tokens = probs.argmax(dim=-1)
    if random:
        index = torch.tensor(random, device=probs.device)
        sub = [rows[i] for i in random]
        noise = exponentials((len(random), probs.shape[1]), sub, probs.device, default)
        tokens[index] = (probs[index] / noise).argmax(dim=-1)
    return tokens


def uniforms(rows: list[SampleRow], count: int, device: torch.device,
             default: torch.Generator | None) -> torch.Tensor:
    """U[0, 1) noise [len(rows), count]."""
    return _noise((len(rows), count), rows, device, default, "uniform_")
