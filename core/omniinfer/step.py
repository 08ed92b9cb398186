"""The plain data of one engine step (vLLM V1's shapes).

The scheduler hands the workers a :class:`SchedulerOutput` and gets a
:class:`ModelRunnerOutput` back for each decode step run. Both hold only lists, dicts, numbers
and `SamplingParams`: no engine object crosses, so nothing under worker/, sampling/,
attention/ or spec_decode/ needs the engine, and the driver worker could live in another
process. Sequences are named by their `seq_id` (a request with n > 1 samples is n sequences
once its prompt is computed).

The driver worker keeps what sampling needs per sequence (its parameters, prompt and seeded
generators) from the step that first schedules it (`new_seqs`) until it is told the sequence
finished (`finished_seq_ids`), as V1's model runner does; the tokens a sequence generated reach
it each step only where sampling or drafting reads them (`token_history`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omniinfer.sampling.params import SamplingParams


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass(slots=True)
class NewSeq:
    """A sequence the worker does not know: new, forked from its request's first sample, or
    back after a preemption (whatever the worker held for it is stale then)."""

    seq_id: int
    request_id: str
    sample_index: int  # within its request: picks its seeded generator
    params: SamplingParams
    prompt_token_ids: list[int]
    eos_token_ids: list[int]
    # a structured output's compiled grammar (omniinfer/structured/): an xgrammar object, which
    # does not pickle; it reaches only the driver worker, which every executor keeps in the
    # engine's process (xgrammar's serialize_json would carry it elsewhere)
    grammar: object = None


@dataclass(slots=True)
class SchedulerOutput:
    """One scheduling step. The per-sequence lists are in batch order: the prefills first (more
    than one new token, or nothing cached yet), then the decodes."""

    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # every new token, flattened in order
    num_scheduled_tokens: list[int] = field(default_factory=list)  # per sequence: its new tokens
    num_computed_tokens: list[int] = field(default_factory=list)  # per sequence: cached before
    block_tables: list[list[int]] = field(default_factory=list)  # per sequence: device block ids
    # per sequence, where the sliding layers have a pool of their own (engine/kv_groups.py):
    # their block ids, aligned with block_tables, -1 for blocks given back; empty otherwise
    window_block_tables: list[list[int]] = field(default_factory=list)
    # per sequence: 0 (a prompt chunk short of its end samples nothing), 1, or n on the step
    # whose logits a request with n > 1 samples all its n first tokens from
    num_samples: list[int] = field(default_factory=list)
    num_prefills: int = 0
    new_seqs: list[NewSeq] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # the worker forgets them
    prompt_logprobs: dict[int, int] = field(default_factory=dict)  # seq_id -> first prompt
    # position whose log-probabilities are still owed (requests that asked for them)
    # seq_id -> every token so far (the prompt, then the generated ones), for the sequences whose
    # sampling reads its history (penalties, min_tokens) and the ones that may be drafted for
    token_history: dict[int, list[int]] = field(default_factory=dict)
    spec_seq_ids: frozenset[int] = frozenset()  # decodes with room for drafted tokens
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device
    window_blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # in the window pool
    num_steps: int = 1  # decode steps to run back to back (multi-step decoding)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers to do (no sequence, no swap)."""
        return not self.seq_ids and not self.blocks_to_swap_out and not self.blocks_to_swap_in


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one decode step produced, per sequence that sampled."""

    seq_ids: list[int] = field(default_factory=list)  # in the order of their logits rows
    # each one's new tokens: one; n where a request takes its n first samples; with
    # speculative decoding the accepted drafts and one more
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: dict[int, list[float]] = field(default_factory=dict)  # seq_id -> raw log-prob of
    # each new token (requests with `logprobs`)
    top_logprobs: dict[int, list[dict[int, Logprob]]] = field(default_factory=dict)
    # seq_id -> (index in the prompt of the first entry, entries)
    prompt_logprobs: dict[int, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # seq_id -> why its sampling failed
    # speculative decoding: sequences drafted for this step, their drafted and kept tokens
    num_drafted_seqs: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
