"""ModelRunnerInputBuilder: scheduled sequences in, one CPU-side ModelInput out."""

from __future__ import annotations

import numpy as np
import torch

from omniinfer.attention.backend import AttentionMetadataBuilder
from omniinfer.attention.common import positions_for
from omniinfer.engine.scheduler import ScheduledSeq
from omniinfer.sampling.metadata import PromptLogprobRows, SamplingMetadata, SpecRows
from omniinfer.worker.model_input import ModelInput


def is_decode(s: ScheduledSeq) -> bool:
    """One new token with something cached before it: the decode kernels' case."""
    return s.num_new_tokens == 1 and s.seq.num_computed_tokens > 0 and not s.spec_tokens


def is_plain_decode(s: ScheduledSeq) -> bool:
    """A decode with nothing special: samples one token, no fork, no prompt log-probs."""
    seq = s.seq
    return (s.num_new_tokens == 1 and seq.group.decodes_plainly and not s.spec_tokens
            and seq.num_computed_tokens + 1 == len(seq.token_ids))


class ModelRunnerInputBuilder:
    """Collects one step's sequences (prefills first, then decodes) and builds the tensors.

    Receives plain data: scheduled sequences and their block tables; the backend's metadata
    builder gets the same, one sequence at a time.
    """

    def __init__(self, attn_builder: AttentionMetadataBuilder):
        self.attn_builder = attn_builder
        self.tokens: list[list[int]] = []
        self.context_lens: list[int] = []
        self.query_lens: list[int] = []
        self.sampling = SamplingMetadata()
        self.sample_rows: list[int] = []  # token row of each sampling sequence
        self.prompt_rows: list[tuple[object, int, int, list[int]]] = []  # (group, first row, first target, targets)
        self.spec: list[tuple[object, int, list[int], object]] = []  # (seq, first row, drafts, probs)
        self.num_tokens = 0

    def add_seq(self, s: ScheduledSeq, block_table: list[int]) -> None:
        seq = s.seq
        ctx, q = seq.num_computed_tokens, s.num_new_tokens
        chunk = seq.token_ids[ctx:ctx + q]
        if s.spec_tokens:  # score the drafts in the same pass: k + 1 rows of logits
            chunk = chunk + s.spec_tokens
            self.spec.append((seq, self.num_tokens + q - 1, s.spec_tokens, s.spec_probs))
            q += len(s.spec_tokens)
        self.tokens.append(chunk)
        self.context_lens.append(ctx)
        self.query_lens.append(q)
        self.attn_builder.add_seq(context_len=ctx, query_len=q, block_table=block_table,
                                  is_prefill=not is_decode(s))
        group = seq.group
        if group.wants_prompt_logprobs and not group.is_forked:
            self._add_prompt_rows(group, ctx, q)
        if s.is_sampling and not s.spec_tokens:
            self.sampling.seqs.append(seq)
            forks = group.params.n > 1 and not group.is_forked
            self.sampling.num_samples.append(group.params.n if forks else 1)
            self.sample_rows.append(self.num_tokens + q - 1)
        self.num_tokens += q

    def add_decodes(self, decodes: list[ScheduledSeq], block_tables: dict[int, list[int]]) -> None:
        """Plain decodes in bulk (one token each, sampling, no fork, no prompt log-probs):
        what `add_seq` does for each, without the per-sequence branches."""
        seqs = [s.seq for s in decodes]
        start, n = self.num_tokens, len(seqs)
        ctx = [seq.num_computed_tokens for seq in seqs]
        self.tokens.append([seq.token_ids[-1] for seq in seqs])
        self.context_lens += ctx
        self.query_lens += [1] * n
        self.attn_builder.add_decodes(ctx, [block_tables[seq.seq_id] for seq in seqs])
        self.sampling.seqs += seqs
        self.sampling.num_samples += [1] * n
        self.sample_rows += range(start, start + n)
        self.num_tokens += n

    def _add_prompt_rows(self, group, ctx: int, q: int) -> None:
        # The logits at position p predict prompt token p + 1; entries already collected
        # (before a preemption) are not computed again.
        done = len(group.prompt_logprobs or [None])
        first = max(ctx, done - 1)
        last = min(ctx + q, len(group.prompt_token_ids) - 1)  # exclusive
        if last > first:
            targets = group.prompt_token_ids[first + 1:last + 1]
            self.prompt_rows.append((group, self.num_tokens + first - ctx, first + 1, targets))

    def build(self) -> ModelInput:
        ctx = np.asarray(self.context_lens, dtype=np.int64)
        q = np.asarray(self.query_lens, dtype=np.int64)
        flat = [t for chunk in self.tokens for t in chunk]
        rows = list(self.sample_rows)
        for seq, start, drafts, probs in self.spec:
            self.sampling.spec_rows.append(SpecRows(seq, len(rows), drafts, probs))
            rows += range(start, start + len(drafts) + 1)
        for group, start, first_target, targets in self.prompt_rows:
            self.sampling.prompt_rows.append(
                PromptLogprobRows(group, len(rows), targets, first_target))
            rows += range(start, start + len(targets))
        return ModelInput(
            input_tokens=torch.tensor(flat, dtype=torch.int64),
            input_positions=torch.from_numpy(positions_for(ctx, q)),
            attn_metadata=self.attn_builder.build(),
            logits_indices=torch.tensor(rows, dtype=torch.int64),
            sampling_metadata=self.sampling,
        )
