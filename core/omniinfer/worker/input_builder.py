"""ModelRunnerInputBuilder: the scheduler's plain data in, one CPU-side ModelInput out.

The batch is described once, as a `CommonAttentionMetadata` (attention/common.py: positions,
slots, lengths, block tables, with numpy), which the backend's builder turns into its own
metadata in one call. The rows of logits the sampler needs are picked here: the last token of
each sampling sequence, then k + 1 rows per sequence scored with k drafted tokens, then the
prompt positions whose log-probabilities a request asked for.
"""

from __future__ import annotations

import numpy as np
import torch

from omniinfer.attention.backend import AttentionMetadataBuilder
from omniinfer.attention.common import build_common
from omniinfer.sampling.metadata import PromptLogprobRows, SamplingMetadata, SeqStates, SpecRows
from omniinfer.step import SchedulerOutput
from omniinfer.worker.model_input import ModelInput

# seq_id -> (k drafted tokens, the [k, vocab] distributions they were drawn from, or None)
Drafts = dict[int, tuple[list[int], torch.Tensor | None]]


class ModelRunnerInputBuilder:
    def __init__(self, attn_builder: AttentionMetadataBuilder, block_size: int):
        self.attn_builder = attn_builder
        self.block_size = block_size

    def build(self, sched: SchedulerOutput, states: SeqStates, drafts: Drafts | None = None) -> ModelInput:
        batch = _Batch.of(sched)
        if drafts:
            batch = batch.with_drafts(drafts)
        common = build_common(batch.ctx, batch.q, batch.tables, batch.num_prefills, self.block_size,
                              self.attn_builder.needs_prefill_key_slots, batch.window_tables)
        ends = np.cumsum(np.asarray(batch.q, dtype=np.int64)) - 1  # each sequence's last row
        md = SamplingMetadata()
        sampling = np.flatnonzero(np.asarray(batch.num_samples, dtype=np.int64))
        if len(sampling) == len(batch.seq_ids):  # every sequence samples (decodes)
            md.seq_ids, md.num_samples = batch.seq_ids, batch.num_samples
        else:
            md.seq_ids = [batch.seq_ids[i] for i in sampling]
            md.num_samples = [batch.num_samples[i] for i in sampling]
        md.seqs = [states[i] for i in md.seq_ids]
        md.prefetch = states.prefetch
        rows = [ends[sampling]]
        num_rows = len(sampling)
        for i, seq_id, tokens, probs in batch.spec:  # the real token, then the drafts
            md.spec_rows.append(SpecRows(states[seq_id], num_rows, tokens, probs))
            start = ends[i] - len(tokens)
            rows.append(np.arange(start, start + len(tokens) + 1))
            num_rows += len(tokens) + 1
        for seq_id, first, first_row, targets in _prompt_rows(batch, sched, states, ends):
            md.prompt_rows.append(PromptLogprobRows(states[seq_id], num_rows, targets, first + 1))
            rows.append(np.arange(first_row, first_row + len(targets)))
            num_rows += len(targets)
        return ModelInput(
            input_tokens=torch.tensor(batch.token_ids, dtype=torch.int64),
            input_positions=common.positions,
            attn_metadata=self.attn_builder.build(common),
            logits_indices=torch.from_numpy(np.concatenate(rows).astype(np.int64)),
            sampling_metadata=md,
            common=common,
        )


def _prompt_rows(batch, sched: SchedulerOutput, states: SeqStates, ends: np.ndarray):
    """(seq_id, first position, its token row, target ids) of each sequence owed
    prompt log-probs this step: the logits at position p predict prompt token p + 1; entries
    already collected (before a preemption) are not computed again."""
    if not sched.prompt_logprobs:
        return
    index = {seq_id: i for i, seq_id in enumerate(batch.seq_ids)}
    for seq_id, done in sched.prompt_logprobs.items():
        i = index[seq_id]
        ctx, q = batch.ctx[i], batch.q[i]
        prompt = states[seq_id].prompt_token_ids
        first = max(ctx, done - 1)
        last = min(ctx + q, len(prompt) - 1)  # exclusive
        if last > first:
            yield seq_id, first, int(ends[i]) - q + 1 + first - ctx, prompt[first + 1:last + 1]


class _Batch:
    """The per-sequence lists of a step, in batch order (the scheduler's, or with drafts)."""

    __slots__ = ("seq_ids", "token_ids", "q", "ctx", "tables", "window_tables", "num_samples",
                 "num_prefills", "spec")

    @classmethod
    def of(cls, sched: SchedulerOutput) -> _Batch:
        b = cls()
        b.seq_ids, b.token_ids, b.q = sched.seq_ids, sched.token_ids, sched.num_scheduled_tokens
        b.ctx, b.tables, b.num_samples = sched.num_computed_tokens, sched.block_tables, sched.num_samples
        b.window_tables = sched.window_block_tables
        b.num_prefills, b.spec = sched.num_prefills, []
        return b

    def with_drafts(self, drafts: Drafts) -> _Batch:
        """Drafted decodes score their token and k drafts in one pass: k + 1 query tokens each,
        so they join the prefills (after them, in order); they sample through their spec rows."""
        n = self.num_prefills
        first_decode_token = sum(self.q[:n])
        drafted = [i for i in range(n, len(self.seq_ids)) if self.seq_ids[i] in drafts]
        rest = [i for i in range(n, len(self.seq_ids)) if self.seq_ids[i] not in drafts]
        order = list(range(n)) + drafted + rest
        b = _Batch()
        b.seq_ids = [self.seq_ids[i] for i in order]
        b.ctx = [self.ctx[i] for i in order]
        b.tables = [self.tables[i] for i in order]
        b.window_tables = [self.window_tables[i] for i in order] if self.window_tables else []
        b.num_samples = [self.num_samples[i] for i in range(n)] + [0] * len(drafted) + [
            self.num_samples[i] for i in rest]
        b.token_ids, b.q, b.spec = self.token_ids[:first_decode_token], self.q[:n], []
        for j, i in enumerate(drafted):
            tokens, probs = drafts[self.seq_ids[i]]
            b.token_ids.append(self.token_ids[first_decode_token + i - n])
            b.token_ids += tokens
            b.q.append(1 + len(tokens))
            b.spec.append((n + j, self.seq_ids[i], tokens, probs))
        b.token_ids += [self.token_ids[first_decode_token + i - n] for i in rest]
        b.q += [1] * len(rest)
        b.num_prefills = n + len(drafted)
        return b
