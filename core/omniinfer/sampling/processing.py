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
    """Repetition (prompt and output), frequency and presence penalties, as vLLM defines them
    (a copy if any row has one). Only the tokens a row has seen change, so only they are
    computed: gathered from the copy, penalised and put back (the [rows, vocab] way took 35 ms a
    step of 32 rows of a 151,936-token vocabulary on a 2-core Zen 4)."""
    if not any(row.params.has_penalties for row in rows):
        return logits
    vocab = logits.shape[1]
    device = logits.device
    seen_rows, seen_ids, out_rows, out_ids = [], [], [], []
    rep, freq, pres = [1.0] * len(rows), [0.0] * len(rows), [0.0] * len(rows)
    for i, row in enumerate(rows):
        p, seq = row.params, row.seq
        if not p.has_penalties:
            continue
        output = seq.output_token_ids + list(row.extra)
        out_rows += [i] * len(output)
        out_ids += output
        if p.repetition_penalty != 1:
            seen_rows += [i] * len(seq.prompt_token_ids)
            seen_ids += seq.prompt_token_ids
        rep[i], freq[i], pres[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
    # (row, token) as one key; the output's keys with their counts, and every seen key
    out_keys = torch.tensor(out_rows, dtype=torch.long, device=device) * vocab + \
        torch.tensor(out_ids, dtype=torch.long, device=device)
    out_keys, counts = out_keys.unique(return_counts=True)  # sorted
    prompt_keys = torch.tensor(seen_rows, dtype=torch.long, device=device) * vocab + \
        torch.tensor(seen_ids, dtype=torch.long, device=device)
    keys = torch.cat([prompt_keys, out_keys]).unique()  # sorted
    if len(keys) == 0:
        return logits
    at = torch.searchsorted(out_keys, keys).clamp_(max=max(len(out_keys) - 1, 0))
    if len(out_keys):
        count = torch.where(out_keys[at] == keys, counts[at], 0).to(logits.dtype)
    else:
        count = torch.zeros(len(keys), dtype=logits.dtype, device=device)
    which = keys // vocab
    rep_t, freq_t, pres_t = (torch.tensor(v, dtype=logits.dtype, device=device)[which]
                             for v in (rep, freq, pres))
    logits = logits.clone(memory_format=torch.contiguous_format)  # (never the caller's)
    flat = logits.view(-1)
    values = flat[keys]
    values = torch.where(values > 0, values / rep_t, values * rep_t)
    flat[keys] = values - freq_t * count - pres_t * (count > 0).to(logits.dtype)
    return logits


# how many of a row's best tokens its top-k / top-p is looked for among, in turn (torch.topk of a
# 151,936-token row on a 2-core Zen 4: 0.26 ms for 64, 1.2 for 4096, 2.9 for 32768, where sorting
# it took 11.5-12.6 ms); a row whose top-p set does not fit in the widest is sorted whole
_CANDIDATES = (64, 4096, 32768)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Each row's `top_k` best tokens, then the fewest of those, best first, whose mass (over
    the top-k, renormalised) reaches `top_p`; -inf for every other token. A row is looked at among
    its _CANDIDATES best tokens first (a row with a top-k: once they hold it): the answer found
    there is the whole row's once every token outside is dropped — by its top-k, or because the
    candidates' mass already reaches top-p. A row that none settles is looked at among its top-k,
    else whole."""
    num_rows, vocab = logits.shape
    device = logits.device
    k_all = torch.tensor(top_k, device=device)
    p_all = torch.tensor(top_p, device=device)
    out = torch.full_like(logits, float("-inf"))
    plain = (k_all >= vocab) & (p_all >= 1)  # rows that keep every token
    out[plain] = logits[plain]
    todo = (~plain).nonzero()[:, 0]
    # what a row's last look saw: how many candidates, their mass, the least one's probability.
    # Every token further down is no more likely than that one, so a row without a top-k is not
    # looked at among `width` tokens that could not hold its top-p set (a flat row: straight to
    # the sort, not through every width first)
    seen = torch.zeros(num_rows, device=device)
    mass = torch.zeros(num_rows, device=device)
    least = torch.full((num_rows,), float("inf"), device=device)
    for width in _CANDIDATES:
        k_rows = k_all[todo]
        count = min(width, vocab)
        could = mass[todo] + (count - seen[todo]) * least[todo] >= p_all[todo]
        take = todo[(k_rows <= width) | ((k_rows >= vocab) & could)]
        if len(take) == 0:
            continue
        if bool((k_all[take] < vocab).all()):  # rows that all have a top-k: their widest
            count = min(count, int(k_all[take].max()))
        settled, mass[take], least[take] = _keep_among_best(logits, out, take, count, k_all, p_all)
        seen[take] = count
        todo = todo[~torch.isin(todo, take[settled])]
    for rows in (todo[k_all[todo] < vocab], todo[k_all[todo] >= vocab]):
        if len(rows):  # (settled: among its top-k, or the whole row)
            _keep_among_best(logits, out, rows, min(vocab, int(k_all[rows].max())), k_all, p_all)
    return out


def _keep_among_best(logits: torch.Tensor, out: torch.Tensor, rows: torch.Tensor, count: int,
                     k_all: torch.Tensor, p_all: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """_top_k_top_p for `rows`, among each one's `count` best tokens: writes the rows it settles
    into `out`, and says which those are, and each row's candidates' mass and least probability."""
    num_rows, vocab = logits.shape
    sub = logits if len(rows) == num_rows else logits[rows]
    k_rows, p_rows = k_all[rows], p_all[rows]
    # best first (the whole row: a sort, which took 201 ms for 32 rows where topk took 213)
    values, order = sub.sort(dim=-1, descending=True) if count >= vocab else sub.topk(count, dim=-1)
    drop = torch.arange(count, device=logits.device)[None, :] >= k_rows[:, None]
    # the top-k renormalised: over a row's k best where it has a top-k, else over the row
    has_k = k_rows < vocab
    top_k_values = values.masked_fill(drop, float("-inf")) if bool(has_k.any()) else values
    total = top_k_values.logsumexp(dim=-1)
    if count < vocab and not bool(has_k.all()):
        total[~has_k] = sub[~has_k].logsumexp(dim=-1)
    probs = (values - total[:, None]).exp().masked_fill(drop, 0.0)
    cum_before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
    # (a row whose top_p is 1 drops nothing: its float32 sums can round up to 1 before the end)
    drop |= (cum_before >= p_rows[:, None]) & (p_rows < 1)[:, None]
    drop[:, 0] = False  # always keep the most likely token
    mass = probs.sum(dim=-1)
    settled = (k_rows <= count) | (mass >= p_rows)
    kept = values.masked_fill(drop, float("-inf"))
    if len(rows) == num_rows and bool(settled.all()):  # (scatter_: 7 ms for 32 whole rows; index_put 17)
        out.scatter_(1, order, kept)
    else:
        out[rows[settled][:, None], order[settled]] = kept[settled]
    return settled, mass, probs[:, -1]


def random_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p -> probabilities (rows are random-sampling rows)."""
    device, vocab = logits.device, logits.shape[1]
    params = [row.params for row in rows]
    temperatures = [p.temperature for p in params]
    if any(t != 1 for t in temperatures):
        logits = logits / torch.tensor(temperatures, device=device)[:, None]
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


def apply_allowed_and_bad_words(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """-inf for every token outside a row's `allowed_token_ids`, and for the last token of each
    of its bad words whose tokens before it end the row's output so far (a copy if needed)."""
    cloned = False
    for i, row in enumerate(rows):
        p = row.params
        allowed, words = p.allowed_token_ids, p.bad_words_token_ids
        if allowed is None and not words:
            continue
        if not cloned:  # never write into the caller's logits
            logits, cloned = logits.clone(), True
        if allowed is not None:
            index = row.seq.allowed_index(logits.device)
            kept = logits[i, index]
            logits[i] = float("-inf")
            logits[i, index] = kept
        if words:
            output = row.seq.output_token_ids + list(row.extra)
            banned = [w[-1] for w in words
                      if len(w) == 1 or (len(w) - 1 <= len(output) and output[len(output) - len(w) + 1:] == w[:-1])]
            if banned:
                logits[i, banned] = float("-inf")
    return logits


def processed(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Allowed tokens and bad words, min-tokens masking, logit bias and penalties: the logits
    every row's choice is made from."""
    logits = apply_allowed_and_bad_words(apply_min_tokens(logits.float(), rows), rows)
    return apply_penalties(apply_logit_bias(logits, rows), rows)


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
           default: torch.Generator | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """U[0, 1) noise per row, from each seeded request's own generator, else from `default`."""
    out = torch.empty(shape, device=device, dtype=dtype)
    unseeded = []
    for i, row in enumerate(rows):
        g = generator_for(row, device)
        if g is None:
            unseeded.append(i)
        else:
            out[i].uniform_(generator=g)
    if unseeded:
        index = torch.tensor(unseeded, device=device)
        noise = torch.empty(len(unseeded), shape[1], device=device, dtype=dtype)
        out[index] = noise.uniform_(generator=default)
    return out


_CHUNK = 1024  # tokens a draw's first step sums at a time
_SUM_ELEMENTS = 1 << 20  # probabilities summed at once (a float64 temporary of 8 MB)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose running mass exceeds u times the row's mass (u in [0, 1)):
    an exact draw from the row's (unnormalised) `probs`, summed in float64. Found in two steps —
    which chunk of _CHUNK tokens, then which token in it — so that no [rows, vocab] float64 copy
    is made. A token of zero probability is never drawn; a row of zeros draws token 0."""
    num_rows, vocab = probs.shape
    device = probs.device
    whole = vocab // _CHUNK * _CHUNK
    # a few rows at a time: summing all 32 rows of a 151,936-token vocabulary at once took 14 ms,
    # its float64 temporary (39 MB) mapped afresh each time; the whole draw takes 1.6-1.9 ms so
    step = max(1, _SUM_ELEMENTS // max(vocab, 1))
    parts = [probs.new_zeros(num_rows, 0, dtype=torch.float64)]
    if whole:
        parts = [probs[r:r + step, :whole].reshape(-1, whole // _CHUNK, _CHUNK).sum(dim=-1, dtype=torch.float64)
                 for r in range(0, num_rows, step)]
    sums = torch.cat(parts)
    if whole < vocab:
        tail = probs[:, whole:].sum(dim=-1, keepdim=True, dtype=torch.float64)
        sums = torch.cat([sums, tail], dim=1)
    upto = sums.cumsum(dim=-1)  # the mass through each chunk
    target = u.to(torch.float64)[:, None] * upto[:, -1:]
    # the first chunk whose running mass exceeds the target; at most the last chunk that has any
    # mass (target can round up to the whole), whose index is where the running mass first is whole
    chunk = torch.searchsorted(upto, target, right=True).minimum(
        torch.searchsorted(upto, upto[:, -1:].contiguous())).clamp_(max=sums.shape[1] - 1)
    before = torch.where(chunk > 0, upto.gather(1, (chunk - 1).clamp(min=0)), 0.0)
    rest = (target - before).clamp_(min=0.0)
    cols = chunk * _CHUNK + torch.arange(_CHUNK, device=device)
    within = probs.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0).cumsum(
        dim=-1, dtype=torch.float64)
    # as above, within the chunk: at most its last token of nonzero probability
    pick = torch.searchsorted(within, rest, right=True).minimum(
        torch.searchsorted(within, within[:, -1:].contiguous()))
    return (chunk * _CHUNK + pick).clamp_(max=vocab - 1)[:, 0]


def draw(probs: torch.Tensor, rows: list[SampleRow], default: torch.Generator | None) -> torch.Tensor:
    """One exact draw per row by inverse transform (`inverse_cdf`), one float64 uniform per row.
    (The exponential race, argmax(probs / Exp(1)), it replaced needed a random number per token:
    2.9-3.7 ms a row for a 151,936-token vocabulary on a 2-core Zen 4.) Greedy rows (one-hot
    probs) take their argmax without drawing."""
    random = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if len(random) == len(rows):
        u = _noise((len(rows), 1), rows, probs.device, default, torch.float64)[:, 0]
        return inverse_cdf(probs, u)
    tokens = probs.argmax(dim=-1)
    if random:
        index = torch.tensor(random, device=probs.device)
        sub = [rows[i] for i in random]
        u = _noise((len(random), 1), sub, probs.device, default, torch.float64)[:, 0]
        tokens[index] = inverse_cdf(probs[index], u)
    return tokens


def uniforms(rows: list[SampleRow], count: int, device: torch.device,
             default: torch.Generator | None) -> torch.Tensor:
    """U[0, 1) noise [len(rows), count]."""
    return _noise((len(rows), count), rows, device, default)
