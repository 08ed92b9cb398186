"""What the sampler needs to know about the rows of logits it receives (driver only)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omniinfer.engine.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class PromptLogprobRows:
    group: SequenceGroup
    start_row: int  # first row of the logits passed to the sampler
    target_ids: list[int]  # the prompt token each row predicts
    first_target: int  # index in the prompt of target_ids[0]


@dataclass(slots=True)
class SpecRows:
    """A sequence scored with k drafted tokens: k + 1 consecutive rows of the logits."""

    seq: Sequence
    start_row: int
    draft_tokens: list[int]  # k
    draft_probs: torch.Tensor  # [k, vocab]: the distributions the drafts were drawn from


@dataclass(slots=True)
class SamplingMetadata:
    """Rows 0..len(seqs)-1 of the logits sample (one sequence each); then come the rows of
    speculatively scored sequences, then prompt log-probability rows."""

    seqs: list[Sequence] = field(default_factory=list)
    num_samples: list[int] = field(default_factory=list)  # n where the row forks its request, else 1
    spec_rows: list[SpecRows] = field(default_factory=list)
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)

    @property
    def num_sampling_rows(self) -> int:
        return len(self.seqs)
