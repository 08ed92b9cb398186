"""What the sampler knows about the sequences it samples (the driver worker's, never the engine's).

`SeqStates` is the driver worker's view of the running sequences, kept from the scheduler's
plain data (`SchedulerOutput.new_seqs` / `finished_seq_ids`, omniinfer/step.py): each
sequence's parameters, prompt and the seeded generators of its request, which must outlive a
preemption. `SamplingMetadata` says which rows of a step's logits belong to which sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omniinfer.step import NewSeq, SchedulerOutput
from omniinfer.structured.state import GrammarState, MaskPrefetch


class SeqState:
    """One running sequence, as sampling and drafting see it."""

    __slots__ = ("seq_id", "request_id", "index", "params", "prompt_token_ids", "eos_token_ids",
                 "generators", "plain_greedy", "token_ids", "grammar", "_allowed")

    def __init__(self, new: NewSeq, generators: dict):
        self.seq_id = new.seq_id
        self.request_id = new.request_id
        self.index = new.sample_index
        self.params = new.params
        self.prompt_token_ids = new.prompt_token_ids
        self.eos_token_ids = new.eos_token_ids
        self.generators = generators  # sample index -> torch.Generator, shared by the request
        # argmax and nothing else (a grammar's mask is something else)
        self.plain_greedy = new.params.is_plain_greedy and new.grammar is None
        # every token so far; current only in a step whose `token_history` holds it (the
        # sequences whose sampling reads it: penalties, min_tokens, drafting)
        self.token_ids = new.prompt_token_ids
        # a structured output's matcher (omniinfer/structured/state.py), caught up from each
        # step's token_history and advanced by the sampler
        self.grammar = None if new.grammar is None else GrammarState(new.grammar, new.eos_token_ids)
        self._allowed = None  # params.allowed_token_ids as a tensor (allowed_index)

    def allowed_index(self, device) -> torch.Tensor:
        """`params.allowed_token_ids` as an int64 tensor on `device`, made once (a list of up to
        2**18 ids took ~15 ms to turn into a tensor: not something to do every step)."""
        if self._allowed is None or self._allowed.device != torch.device(device):
            self._allowed = torch.tensor(self.params.allowed_token_ids, dtype=torch.long, device=device)
        return self._allowed

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)


class SeqStates(dict):
    """seq_id -> SeqState, updated from each step's SchedulerOutput."""

    def __init__(self):
        super().__init__()
        self.requests: dict[str, tuple[dict, set[int]]] = {}  # id -> (generators, its seq ids)
        self.prefetch = MaskPrefetch()  # grammar masks computed while the model runs

    def update(self, sched: SchedulerOutput) -> list[int]:
        """Forget the finished, add the new (a known id comes back after a preemption: its state
        is made again, its request's generators kept); take this step's token histories.
        Returns the ids made again or forgotten (whatever else is held for them is stale)."""
        stale = list(sched.finished_seq_ids)
        for seq_id in sched.finished_seq_ids:
            state = self.pop(seq_id, None)
            if state is not None:
                generators, ids = self.requests[state.request_id]
                ids.discard(seq_id)
                if not ids:
                    del self.requests[state.request_id]
        for new in sched.new_seqs:
            if new.seq_id in self:
                stale.append(new.seq_id)
            generators, ids = self.requests.setdefault(new.request_id, ({}, set()))
            ids.add(new.seq_id)
            self[new.seq_id] = SeqState(new, generators)
        for seq_id, token_ids in sched.token_history.items():
            state = self[seq_id]
            state.token_ids = token_ids
            if state.grammar is not None and state.grammar.num_accepted != state.num_output_tokens:
                self.prefetch.join()  # (it reads the matchers; usually they are current)
                state.grammar.sync(state.output_token_ids)
        return stale


@dataclass(slots=True)
class PromptLogprobRows:
    seq: SeqState
    start_row: int  # first row of the logits passed to the sampler
    target_ids: list[int]  # the prompt token each row predicts
    first_target: int  # index in the prompt of target_ids[0]


@dataclass(slots=True)
class SpecRows:
    """A sequence scored with k drafted tokens: k + 1 consecutive rows of the logits."""

    seq: SeqState
    start_row: int
    draft_tokens: list[int]  # k
    draft_probs: torch.Tensor | None  # [k, vocab]: the distributions the drafts were drawn from


@dataclass(slots=True)
class SamplingMetadata:
    """Rows 0..len(seqs)-1 of the logits sample (one sequence each); then come the rows of
    speculatively scored sequences, then prompt log-probability rows."""

    seqs: list[SeqState] = field(default_factory=list)
    seq_ids: list[int] = field(default_factory=list)  # the same sequences' ids
    num_samples: list[int] = field(default_factory=list)  # n where the row forks its request, else 1
    spec_rows: list[SpecRows] = field(default_factory=list)
    prompt_rows: list[PromptLogprobRows] = field(default_factory=list)
    prefetch: MaskPrefetch | None = None  # the states' grammar-mask prefetch (structured output)

    @property
    def num_sampling_rows(self) -> int:
        return len(self.seqs)
