"""Turn logits into tokens: penalties, temperature, top-k/top-p/min-p, greedy or random.

Random sampling draws `argmax(probs / Exp(1))` (the exponential race), which is an exact
draw from `probs`. Seeded requests draw their exponentials from their own generator, so
their tokens do not depend on what else is in the batch. Log-probabilities returned to
users are the raw model's (log_softmax of the logits before any processing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omniinfer.engine.sequence import Logprob, Sequence
from omniinfer.sampling.metadata import SamplingMetadata

_SEED_STRIDE = 0x9E3779B97F4A7C15  # spreads the seeds of a request's n samples


@dataclass(slots=True)
class SeqSample:
    token_ids: list[int]  # one per sample (n on the row that forks a request)
    logprobs: list[float] | None = None  # raw log-probability of each chosen token
    top_logprobs: list[dict[int, Logprob]] | None = None  # per sample, when requested


@dataclass
class SamplerOutput:
    samples: dict[int, SeqSample] = field(default_factory=dict)  # seq_id -> sample
    prompt_logprobs: dict[str, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    # request_id -> (index in the prompt of the first entry, entries)


def generator_for(seq: Sequence, index: int, device: torch.device) -> torch.Generator | None:
    """The generator of sample `index` of a seeded request (created on first use)."""
    group = seq.group
    seed = group.params.seed
    if seed is None:
        return None
    gens = group.generators
    if index not in gens:
        g = torch.Generator(device=device)
        g.manual_seed((seed + index * _SEED_STRIDE) % (1 << 63))
        gens[index] = g
    return gens[index]


class Sampler:
    def __init__(self, vocab_size: int, generator: torch.Generator | None = None):
        self.vocab_size = vocab_size
        self.generator = generator  # for unseeded requests

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        out = SamplerOutput()
        logits = logits[:, : self.vocab_size]
        if md.num_sampling_rows:
            self._sample(logits[: md.num_sampling_rows], md, out)
        for rows in md.prompt_rows:
            out.prompt_logprobs[rows.group.request_id] = (
                rows.first_target, self._prompt_logprobs(logits, rows))
        return out

    # ---- sampling ----------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, md: SamplingMetadata, out: SamplerOutput) -> None:
        rows: list[tuple[Sequence, int]] = []  # (sequence, sample index) per expanded row
        for seq, n in zip(md.seqs, md.num_samples):
            rows += [(seq, seq.index if n == 1 else k) for k in range(n)]
        if len(rows) != logits.shape[0]:
            index = torch.tensor([i for i, n in enumerate(md.num_samples) for _ in range(n)],
                                 device=logits.device)
            logits = logits[index]
        logits = logits.float()
        params = [seq.group.params for seq, _ in rows]
        want_logprobs = any(p.logprobs is not None for p in params)
        raw = torch.log_softmax(logits, dim=-1) if want_logprobs else None

        logits = self._apply_min_tokens(logits, rows)
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits, rows)
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        random = [i for i, p in enumerate(params) if not p.is_greedy]
        if greedy:
            g = torch.tensor(greedy, device=logits.device)
            tokens[g] = logits[g].argmax(dim=-1)
        if random:
            r = torch.tensor(random, device=logits.device)
            tokens[r] = self._sample_random(logits[r], [rows[i] for i in random],
                                            [params[i] for i in random])
        self._collect(tokens, raw, rows, params, out)

    def _apply_min_tokens(self, logits: torch.Tensor, rows) -> torch.Tensor:
        cloned = False
        for i, (seq, _) in enumerate(rows):
            p = seq.group.params
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else seq.group.eos_token_ids)
                banned = [t for t in banned if t < self.vocab_size]
                if banned:
                    if not cloned:  # never write into the caller's logits
                        logits, cloned = logits.clone(), True
                    logits[i, banned] = float("-inf")
        return logits

    def _apply_penalties(self, logits: torch.Tensor, rows) -> torch.Tensor:
        num_rows, vocab = logits.shape
        device = logits.device
        counts = torch.zeros(num_rows, vocab, device=device)
        seen_prompt = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)
        rep = torch.ones(num_rows, 1, device=device)
        freq = torch.zeros(num_rows, 1, device=device)
        pres = torch.zeros(num_rows, 1, device=device)
        for i, (seq, _) in enumerate(rows):
            p = seq.group.params
            if not p.has_penalties:
                continue
            out_ids = seq.output_token_ids
            if out_ids:
                ids = torch.tensor(out_ids, device=device)
                counts[i].index_add_(0, ids, torch.ones(len(out_ids), device=device))
            if p.repetition_penalty != 1:
                seen_prompt[i, torch.tensor(seq.token_ids[: seq.num_prompt_tokens], device=device)] = True
            rep[i], freq[i], pres[i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
        seen = seen_prompt | (counts > 0)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        return logits - freq * counts - pres * (counts > 0).float()

    def _sample_random(self, logits: torch.Tensor, rows, params) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)[:, None]
        logits = logits / temps
        top_k = [p.top_k if p.top_k > 0 else self.vocab_size for p in params]
        top_p = [p.top_p for p in params]
        if any(k < self.vocab_size for k in top_k) or any(tp < 1 for tp in top_p):
            logits = self._top_k_top_p(logits, top_k, top_p)
        probs = torch.softmax(logits, dim=-1)
        min_p = [p.min_p for p in params]
        if any(min_p):
            threshold = torch.tensor(min_p, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
        q = torch.empty_like(probs)
        unseeded = []
        for i, ((seq, index), p) in enumerate(zip(rows, params)):
            g = generator_for(seq, index, device) if p.seed is not None else None
            if g is None:
                unseeded.append(i)
            else:
                q[i].exponential_(generator=g)
        if unseeded:
            u = torch.tensor(unseeded, device=device)
            q[u] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_(
                generator=self.generator)
        return (probs / q).argmax(dim=-1)

    @staticmethod
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

    # ---- results ---------------------------------------------------------------------------------------
    def _collect(self, tokens, raw, rows, params, out: SamplerOutput) -> None:
        token_list = tokens.tolist()
        chosen_lp = ranks = tops = None
        if raw is not None:
            chosen = raw.gather(1, tokens[:, None])
            chosen_lp = chosen[:, 0].tolist()
            ranks = ((raw > chosen).sum(dim=1) + 1).tolist()
            max_n = max(p.logprobs or 0 for p in params)
            if max_n:
                top_vals, top_ids = raw.topk(max_n, dim=-1)
                tops = (top_vals.tolist(), top_ids.tolist())
        for i, (seq, _) in enumerate(rows):
            sample = out.samples.get(seq.seq_id)
            if sample is None:
                sample = out.samples[seq.seq_id] = SeqSample([])
            sample.token_ids.append(token_list[i])
            p = params[i]
            if p.logprobs is None:
                continue
            if sample.logprobs is None:
                sample.logprobs, sample.top_logprobs = [], []
            sample.logprobs.append(chosen_lp[i])
            entry = {token_list[i]: Logprob(chosen_lp[i], ranks[i])}
            if p.logprobs:
                for r in range(p.logprobs):
                    tid = tops[1][i][r]
                    if tid not in entry:
                        entry[tid] = Logprob(tops[0][i][r], r + 1)
            sample.top_logprobs.append(entry)

    def _prompt_logprobs(self, logits: torch.Tensor, rows) -> list[dict[int, Logprob]]:
        n = len(rows.target_ids)
        lp = torch.log_softmax(logits[rows.start_row: rows.start_row + n].float(), dim=-1)
        targets = torch.tensor(rows.target_ids, device=lp.device)
        chosen = lp.gather(1, targets[:, None])
        chosen_lp = chosen[:, 0].tolist()
        ranks = ((lp > chosen).sum(dim=1) + 1).tolist()
        k = rows.group.params.prompt_logprobs
        top = lp.topk(k, dim=-1) if k else None
        top_vals, top_ids = (top.values.tolist(), top.indices.tolist()) if k else ([], [])
        entries = []
        for i, tid in enumerate(rows.target_ids):
            entry = {tid: Logprob(chosen_lp[i], ranks[i])}
            for r in range(k):
                if top_ids[i][r] not in entry:
                    entry[top_ids[i][r]] = Logprob(top_vals[i][r], r + 1)
            entries.append(entry)
        return entries
