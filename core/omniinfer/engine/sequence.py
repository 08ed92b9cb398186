"""Requests and their sequences: plain Python state owned by the engine side (the scheduler
keeps the tokens and statuses, the output processor the text and log-probs).

A request (`SequenceGroup`) holds one prompt and its sampling parameters. It starts with
one `Sequence`; a request with n > 1 forks into n sequences once its prompt is computed,
the children sharing the prompt's KV blocks. None of this crosses into the workers: the
scheduler describes each step to them as plain data (omniinfer/step.py).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from omniinfer.sampling.params import SamplingParams
from omniinfer.step import Logprob  # noqa: F401 - where the engine's users import it from


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort", 6: "error"}.get(int(self))


_FIRST_FINISHED = SequenceStatus.FINISHED_STOPPED


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Content hash of a full KV block: its tokens and everything before it."""
    return hash((parent, tokens))


class Sequence:
    """One stream of tokens: the prompt and what has been generated after it."""

    __slots__ = (
        "seq_id", "group", "index", "token_ids", "num_prompt_tokens", "num_computed_tokens",
        "status", "block_hashes", "block_size", "cumulative_logprob", "output_logprobs",
        "output_text", "detok", "detok_pos", "stop_reason", "num_preemptions",
    )

    def __init__(self, seq_id: int, group: SequenceGroup, index: int, token_ids: list[int],
                 num_prompt_tokens: int, block_size: int):
        self.seq_id = seq_id
        self.group = group
        self.index = index  # sample index within the request (0..n-1)
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0  # tokens whose keys/values are in the cache
        self.status = SequenceStatus.WAITING
        self.block_size = block_size
        self.block_hashes: list[int] = []  # chained hash of every full block of token_ids
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict[int, Logprob]] | None = None
        self.output_text = ""
        self.detok = None  # incremental detokenizer (the output processor's, made on first use)
        self.detok_pos = num_prompt_tokens  # token_ids[detok_pos:] are not fed to it yet
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.extend_block_hashes()

    @property
    def request_id(self) -> str:
        return self.group.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            self.extend_block_hashes()

    def extend_block_hashes(self) -> None:
        """Hash every full block of token_ids not hashed yet (call when a block fills)."""
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(chain_hash(parent, tuple(self.token_ids[i * bs:(i + 1) * bs])))

    def fork(self, seq_id: int, index: int) -> Sequence:
        child = Sequence.__new__(Sequence)
        for name in Sequence.__slots__:
            setattr(child, name, getattr(self, name))
        child.seq_id, child.index = seq_id, index
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
        child.output_logprobs = None if self.output_logprobs is None else list(self.output_logprobs)
        child.detok = None  # its own, made when its text is first wanted
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, {self.status.name})")


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)
class SequenceGroup:
    """One request: a prompt, its sampling parameters and its n sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None
    is_internal_error: bool = False  # the error is the engine's (a failed step), not the request's
    is_forked: bool = False
    max_tokens: int = 0  # resolved budget of generated tokens
    eos_token_ids: list[int] = field(default_factory=list)
    stream: bool = True  # outputs every step (else only when finished)
    # set in __post_init__ / mark_forked: one token a step, no fork to make, no prompt log-probs
    decodes_plainly: bool = field(init=False, default=False)
    # the output processor looks at each new token (stop strings, log-probs); else at the text
    # only when it is read
    watches_tokens: bool = field(init=False, default=False)
    # its sampling reads the tokens generated so far (penalties, min_tokens, bad words): sent each step
    reads_history: bool = field(init=False, default=False)
    metrics: RequestMetrics | None = None
    grammar: object = None  # the compiled grammar of a structured output (structured/engine.py)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(self.arrival_time)
        self.decodes_plainly = self.params.n == 1 and self.params.prompt_logprobs is None
        self.watches_tokens = bool(self.params.stop) or self.params.logprobs is not None
        self.reads_history = (self.params.has_penalties or self.params.min_tokens > 0
                              or self.params.structured_outputs is not None
                              or bool(self.params.bad_words))

    def mark_forked(self) -> None:
        self.is_forked = True
        self.decodes_plainly = self.params.prompt_logprobs is None

    def decodes_ahead(self, num_output_tokens: int) -> bool:
        """Whether several decode steps may run before the engine sees their tokens: a plain
        decode whose sampling reads nothing that those tokens change (no penalties, min_tokens
        already reached, no bad words)."""
        p = self.params
        return (self.decodes_plainly and not p.has_penalties and not p.bad_words
                and num_output_tokens >= p.min_tokens)

    @property
    def is_finished(self) -> bool:
        if self.error is not None:
            return True
        return all(s.status >= _FIRST_FINISHED for s in self.seqs)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and (
            self.prompt_logprobs is None or len(self.prompt_logprobs) < len(self.prompt_token_ids))
