"""Turn logits into tokens: penalties, temperature, top-k/top-p/min-p, greedy or random.

Random sampling draws one uniform per row and takes the first token whose running mass passes
it (`processing.inverse_cdf`), an exact draw from `probs`. Seeded requests draw their uniforms
from their own generator, so their tokens do not depend on what else is in the batch.
Log-probabilities returned to users are the raw model's (log_softmax of the logits before any
processing).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from omniinfer.platforms.host import usable_cpus
from omniinfer.sampling.metadata import SamplingMetadata, SpecRows
from omniinfer.sampling.processing import (
    SampleRow,
    draw,
    processed,
    random_probs,
    sampling_probs,
)
from omniinfer.sampling.rejection import rejection_sample
from omniinfer.step import Logprob, ModelRunnerOutput
from omniinfer.structured.sampling import after_sampling, has_grammar, mask_rows, mask_spec_rows

# errors of the device itself: never blamed on a request
_DEVICE_ERRORS = (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", torch.OutOfMemoryError))


# `logprob_table` takes log_softmax this many bytes of float32 rows at a time: taken whole, a
# 2048-token prompt chunk's of a 151,936-token vocabulary was a 1.2 GB copy beside its logits
_LOGPROB_CHUNK_BYTES = 16 << 20


def logprob_table(scores: torch.Tensor, ids: torch.Tensor, k: int, normalise: bool = True
                  ) -> tuple[list[float], list[int], list[list[float]], list[list[int]]]:
    """Per row of `scores` ([rows, vocab]): the log-prob of its token in `ids` ([rows] int64),
    that token's rank (1: the most likely) and the row's `k` best log-probs with their tokens.
    `scores` are logits (`normalise`: log_softmax is taken here) or log-probs already.

    Rows are taken a few at a time (`_LOGPROB_CHUNK_BYTES`), each chunk's values those of the
    whole-tensor ops, written into buffers made once: what this allocates beside `scores` stays
    small however many rows there are. (A fresh log_softmax a chunk left the heap fragmented:
    measured, 1 run in 3 of a 2048-row chunk grew the process by 1.2-2.3 GB, and every chunk
    paid its page faults.) The rank sums the comparison's bytes as uint8 into int32: summed as
    bool, torch makes an int64 copy first (14 ms for 32 rows of a 151,936-token vocabulary).
    The results reach the host once, at the end (one device sync, not one a chunk)."""
    rows, vocab = scores.shape
    per_chunk = max(1, min(rows, _LOGPROB_CHUNK_BYTES // (4 * max(1, vocab))))
    device = scores.device
    chosen = torch.empty(rows, 1, device=device)
    ranks = torch.empty(rows, dtype=torch.int32, device=device)
    top_vals = torch.empty(rows, k, device=device)
    top_ids = torch.empty(rows, k, dtype=torch.long, device=device)
    copy = normalise or scores.dtype != torch.float32
    lp_buffer = torch.empty(per_chunk, vocab, device=device) if copy else None
    above = torch.empty(per_chunk, vocab, dtype=torch.bool, device=device)
    for start in range(0, rows, per_chunk):
        end = min(start + per_chunk, rows)
        part = scores[start:end]
        lp = part if lp_buffer is None else lp_buffer[: end - start]
        if normalise:
            torch.log_softmax(part, dim=-1, dtype=torch.float32, out=lp)
        elif copy:
            lp.copy_(part)
        torch.gather(lp, 1, ids[start:end, None], out=chosen[start:end])
        torch.gt(lp, chosen[start:end], out=above[: end - start])
        torch.sum(above[: end - start].view(torch.uint8), dim=1, dtype=torch.int32, out=ranks[start:end])
        if k == 1:  # (the argmax: on the CPU 25 ms for 2048 rows where topk took 190)
            top_ids[start:end, 0] = greedy_tokens(lp)
            torch.gather(lp, 1, top_ids[start:end], out=top_vals[start:end])
        elif k:
            torch.topk(lp, k, dim=-1, out=(top_vals[start:end], top_ids[start:end]))
    ranks += 1
    return chosen[:, 0].tolist(), ranks.tolist(), top_vals.tolist(), top_ids.tolist()


class _Draws:
    """What a step sampled, sequence by sequence, until it becomes a ModelRunnerOutput."""

    def __init__(self):
        self.tokens: dict[int, list[int]] = {}  # seq_id -> new tokens, in row order
        self.logprobs: dict[int, list[float]] = {}
        self.top_logprobs: dict[int, list[dict[int, Logprob]]] = {}
        self.prompt_logprobs: dict[int, tuple[int, list[dict[int, Logprob]]]] = {}

    def output(self, out: ModelRunnerOutput) -> ModelRunnerOutput:
        out.seq_ids, out.token_ids = list(self.tokens), list(self.tokens.values())
        out.logprobs, out.top_logprobs = self.logprobs, self.top_logprobs
        out.prompt_logprobs = self.prompt_logprobs
        return out


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax of every row ([rows] int64). On the CPU numpy's argmax is many times faster than
    torch's (measured: 1 ms against 23 ms for [256, 32000] float32 on one core), and big batches
    split across the usable cores (memory-bound: 0.76 -> 0.37 ms on two)."""
    if logits.device.type == "cpu":
        return torch.from_numpy(_cpu_argmax(logits.float().numpy()).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


_ARGMAX_POOL: ThreadPoolExecutor | None = None
_PARALLEL_ARGMAX_ELEMENTS = 1 << 20  # below this one thread is faster than a hand-off


def _cpu_argmax(array: np.ndarray) -> np.ndarray:
    global _ARGMAX_POOL
    workers = min(usable_cpus(), 8, array.shape[0])
    if workers < 2 or array.size < _PARALLEL_ARGMAX_ELEMENTS:
        return array.argmax(axis=-1)
    if _ARGMAX_POOL is None:
        _ARGMAX_POOL = ThreadPoolExecutor(workers - 1, thread_name_prefix="omniinfer-argmax")
    chunks = np.array_split(array, workers)
    futures = [_ARGMAX_POOL.submit(np.argmax, chunk, -1) for chunk in chunks[1:]]
    return np.concatenate([chunks[0].argmax(axis=-1)] + [f.result() for f in futures])


def _matched(drafts: list[int], targets: list[int]) -> list[int]:
    """The drafts up to the first that differs from the target's choice there, then that
    choice (the bonus token when all match)."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
        accepted += 1
    return drafts[:accepted] + [targets[accepted]]


class Sampler:
    def __init__(self, vocab_size: int, generator: torch.Generator | None = None,
                 argmax_rows: Callable[[torch.Tensor], torch.Tensor] = greedy_tokens):
        self.vocab_size = vocab_size
        self.generator = generator  # for unseeded requests
        self.argmax_rows = argmax_rows  # the greedy fast paths' argmax (a platform's LayerOps)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata
                 ) -> tuple[ModelRunnerOutput, torch.Tensor | None]:
        """Sample every row: the step's output, and (when every sampling row drew one token)
        those tokens as a [rows] int64 tensor on the device, which multi-step decoding feeds to
        the next step. If sampling the batch fails, each request is sampled alone, so that a
        failure tied to one request's parameters or rows ends only that request
        (`ModelRunnerOutput.failed`); a device failure (out of memory, an accelerator error) is
        raised."""
        try:
            out, tokens = self._sample_all(logits, md)
        except _DEVICE_ERRORS:
            raise
        except Exception:  # noqa: BLE001 - sorted out request by request below
            out, tokens = self._sample_each(logits, md)
        if md.prefetch is not None and has_grammar(md):
            after_sampling(md, out, self.vocab_size)
        return out, tokens

    def _sample_all(self, logits: torch.Tensor, md: SamplingMetadata):
        draws = _Draws()
        tokens = None
        # (each slicing call costs ~20 us here, right after the LM head: made only when needed)
        if logits.shape[1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]
        if md.num_sampling_rows:
            rows = md.num_sampling_rows
            part = logits if logits.shape[0] == rows else logits[:rows]
            if not md.spec_rows and not md.prompt_rows and self.greedy_only(md):
                tokens = self.argmax_rows(part)  # the common case, with no per-row work at all
                return self.greedy_output(tokens, md), tokens
            tokens = self._sample(part, md, draws)
        if md.spec_rows:
            self._verify(logits, md.spec_rows, draws, md.prefetch)
        for rows in md.prompt_rows:
            draws.prompt_logprobs[rows.seq.seq_id] = (rows.first_target, self._prompt_logprobs(logits, rows))
        return draws.output(ModelRunnerOutput()), tokens

    def _sample_each(self, logits: torch.Tensor, md: SamplingMetadata):
        # Even when every request fails alone, each is failed rather than the engine: a batch
        # of nothing but bad requests must not take the engine down either.
        if logits.shape[1] != self.vocab_size:
            logits = logits[:, : self.vocab_size]
        parts: dict[str, SamplingMetadata] = {}
        rows: dict[str, list[int]] = {}
        for i, (seq, n) in enumerate(zip(md.seqs, md.num_samples)):
            part = parts.setdefault(seq.request_id, SamplingMetadata())
            part.seqs.append(seq)
            part.seq_ids.append(seq.seq_id)
            part.num_samples.append(n)
            rows.setdefault(seq.request_id, []).append(i)
        for spec in md.spec_rows:
            parts.setdefault(spec.seq.request_id, SamplingMetadata()).spec_rows.append(spec)
        for prompt in md.prompt_rows:
            parts.setdefault(prompt.seq.request_id, SamplingMetadata()).prompt_rows.append(prompt)
        draws, failed = _Draws(), {}
        for request_id, part in parts.items():
            alone = _Draws()
            try:
                if part.seqs:
                    index = torch.tensor(rows[request_id], device=logits.device)
                    self._sample(logits[index], part, alone)
                if part.spec_rows:
                    self._verify(logits, part.spec_rows, alone)
                for prompt in part.prompt_rows:
                    alone.prompt_logprobs[prompt.seq.seq_id] = (prompt.first_target,
                                                                self._prompt_logprobs(logits, prompt))
            except _DEVICE_ERRORS:
                raise
            except Exception as e:  # noqa: BLE001 - this request's own failure
                seq = (part.seqs or [r.seq for r in part.spec_rows] or [part.prompt_rows[0].seq])[0]
                failed[seq.seq_id] = f"{type(e).__name__}: {e}"
                continue
            for name in ("tokens", "logprobs", "top_logprobs", "prompt_logprobs"):
                getattr(draws, name).update(getattr(alone, name))
        out = draws.output(ModelRunnerOutput(failed=failed))
        tokens = None
        if not md.spec_rows and max(md.num_samples, default=1) == 1:
            # multi-step decoding feeds these to the next step; a failed row's placeholder is
            # computed but never used (the engine ends its request)
            tokens = torch.tensor([draws.tokens[seq.seq_id][0] if seq.seq_id in draws.tokens else 0
                                   for seq in md.seqs], dtype=torch.long, device=logits.device)
        return out, tokens

    # ---- sampling ----------------------------------------------------------------------------------
    def greedy_output(self, tokens: torch.Tensor, md: SamplingMetadata) -> ModelRunnerOutput:
        """The output of an all-greedy step (`greedy_only`) whose tokens, one per sequence, were
        taken elsewhere (the LM head's `greedy_tokens`), or by the argmax here."""
        return ModelRunnerOutput(seq_ids=md.seq_ids, token_ids=[[t] for t in tokens.tolist()])

    def _sample(self, logits: torch.Tensor, md: SamplingMetadata, out: _Draws) -> torch.Tensor | None:
        """Sample the rows of `md.seqs`; returns their tokens when each drew one."""
        if self.greedy_only(md):
            tokens = self.argmax_rows(logits)
            for seq_id, token in zip(md.seq_ids, tokens.tolist()):
                out.tokens[seq_id] = [token]
            return tokens
        rows: list[SampleRow] = []  # one per sampled token (n on a row that forks its request)
        for seq, n in zip(md.seqs, md.num_samples):
            rows += [SampleRow(seq, seq.index if n == 1 else k) for k in range(n)]
        if len(rows) != logits.shape[0]:
            index = torch.tensor([i for i, n in enumerate(md.num_samples) for _ in range(n)],
                                 device=logits.device)
            logits = logits[index]
        logits = logits.float()
        want_logprobs = any(row.params.logprobs is not None for row in rows)
        raw = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        row_seqs = None if len(rows) == len(md.seqs) else [
            i for i, n in enumerate(md.num_samples) for _ in range(n)]
        logits = processed(mask_rows(logits, md, row_seqs), rows)
        greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
        random = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        # (no [rows, vocab] copy picking the rows when all are alike; greedy ones take the
        # platform's argmax, on the CPU numpy's: torch's took 2.7 ms for 32 rows of a
        # 151,936-token vocabulary)
        if not random:
            tokens = self.argmax_rows(logits)
        elif not greedy:
            tokens = draw(random_probs(logits, rows), rows, self.generator)
        else:
            tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            g = torch.tensor(greedy, device=logits.device)
            tokens[g] = self.argmax_rows(logits[g])
            r = torch.tensor(random, device=logits.device)
            random_rows = [rows[i] for i in random]
            tokens[r] = draw(random_probs(logits[r], random_rows), random_rows, self.generator)
        self._collect(tokens, raw, rows, out)
        return tokens if len(rows) == len(md.seqs) else None

    @staticmethod
    def greedy_only(md: SamplingMetadata) -> bool:
        """Every row: one greedy token, no log-probs, penalties or min_tokens."""
        if max(md.num_samples) != 1:
            return False
        return all(seq.plain_greedy for seq in md.seqs)

    def _verify(self, logits: torch.Tensor, spec: list[SpecRows], out: _Draws,
                prefetch=None) -> None:
        """Rejection-sample the drafted tokens of speculatively scored sequences."""
        k = len(spec[0].draft_tokens)
        assert all(len(s.draft_tokens) == k for s in spec), "one k per step"
        index = torch.tensor([s.start_row + j for s in spec for j in range(k + 1)],
                             device=logits.device)
        scored = mask_spec_rows(logits[index], spec, prefetch)  # structured outputs: the grammar's
        plain = all(s.seq.params.is_plain_greedy for s in spec)
        rows = None if plain else [SampleRow(s.seq, s.seq.index, tuple(s.draft_tokens[:j]))
                                   for s in spec for j in range(k + 1)]
        if plain or all(s.seq.params.is_greedy for s in spec):
            # one-hot p and q (the draft drew no distributions): prefix matching against the
            # argmax, of the logits as each position's history changes them (penalties, bad words)
            targets = self.argmax_rows(scored if plain else processed(scored.float(), rows)).tolist()
            results = [_matched(s.draft_tokens, targets[i * (k + 1): (i + 1) * (k + 1)])
                       for i, s in enumerate(spec)]
            if plain:  # (no log-probs to collect)
                for s, tokens in zip(spec, results):
                    out.tokens[s.seq.seq_id] = tokens
                return
        else:
            p = sampling_probs(scored.float(), rows).view(len(spec), k + 1, -1)
            drafts = torch.tensor([s.draft_tokens for s in spec], device=logits.device)
            q = torch.stack([s.draft_probs for s in spec]).to(p.device, p.dtype)
            results = rejection_sample(p, drafts, q, [SampleRow(s.seq, s.seq.index) for s in spec],
                                       self.generator).tokens
        want_logprobs = any(s.seq.params.logprobs is not None for s in spec)
        raw = torch.log_softmax(logits[index].float(), dim=-1) if want_logprobs else None
        for i, tokens in enumerate(results):
            emitted = [rows[i * (k + 1) + j] for j in range(len(tokens))]
            sub = None if raw is None else raw[i * (k + 1): i * (k + 1) + len(tokens)]
            self._collect(torch.tensor(tokens, device=logits.device), sub, emitted, out)

    # ---- results ---------------------------------------------------------------------------------------
    def _collect(self, tokens, raw, rows: list[SampleRow], out: _Draws) -> None:
        token_list = tokens.tolist()
        chosen_lp = ranks = top_vals = top_ids = None
        if raw is not None:
            max_n = max(row.params.logprobs or 0 for row in rows)
            chosen_lp, ranks, top_vals, top_ids = logprob_table(raw, tokens, max_n, normalise=False)
        for i, row in enumerate(rows):
            seq_id = row.seq.seq_id
            out.tokens.setdefault(seq_id, []).append(token_list[i])
            p = row.params
            if p.logprobs is None:
                continue
            out.logprobs.setdefault(seq_id, []).append(chosen_lp[i])
            entry = {token_list[i]: Logprob(chosen_lp[i], ranks[i])}
            if p.logprobs:
                for r in range(p.logprobs):
                    tid = top_ids[i][r]
                    if tid not in entry:
                        entry[tid] = Logprob(top_vals[i][r], r + 1)
            out.top_logprobs.setdefault(seq_id, []).append(entry)

    def _prompt_logprobs(self, logits: torch.Tensor, rows) -> list[dict[int, Logprob]]:
        n = len(rows.target_ids)
        targets = torch.tensor(rows.target_ids, device=logits.device)
        k = rows.seq.params.prompt_logprobs
        chosen_lp, ranks, top_vals, top_ids = logprob_table(
            logits[rows.start_row: rows.start_row + n], targets, k)
        entries = []
        for i, tid in enumerate(rows.target_ids):
            entry = {tid: Logprob(chosen_lp[i], ranks[i])}
            for r in range(k):
                if top_ids[i][r] not in entry:
                    entry[top_ids[i][r]] = Logprob(top_vals[i][r], r + 1)
            entries.append(entry)
        return entries
