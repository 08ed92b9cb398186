"""The per-sequence grammar state the driver worker keeps, and the masks it gives the sampler.

A `GrammarState` is one sequence's xgrammar matcher plus how many of its generated tokens the
matcher has taken. It is caught up from the sequence's tokens whenever the scheduler sends them
(`SchedulerOutput.token_history`, which every constrained sequence gets each step it is
described: a fork, a preemption and recompute, or a missed step all replay), and advanced by
the sampler itself with what it draws (multi-step decoding runs several steps before the
scheduler sees their tokens).

Masks are bitmasks (int32 words, bit i of word w allows token 32 w + i, xgrammar's layout) that
`mask.py` turns into a boolean keep-mask and applies to the logits with plain torch ops.
`MaskPrefetch` computes the next step's masks on a helper thread as soon as a step has
sampled, so that they are ready (computed while the model runs) when the next step samples;
xgrammar releases the GIL while it fills a mask.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from omniinfer.structured.mask import unpack_bias


class GrammarState:
    __slots__ = ("matcher", "num_accepted", "_compiled", "_eos")

    def __init__(self, compiled, eos_token_ids: list[int]):
        self._compiled = compiled
        self._eos = list(eos_token_ids)
        self.matcher = self._new_matcher()
        self.num_accepted = 0  # generated tokens the matcher has taken

    def _new_matcher(self):
        from omniinfer.structured.engine import import_xgrammar

        return import_xgrammar().GrammarMatcher(self._compiled)  # (rolls back any number)

    def sync(self, output_token_ids: list[int]) -> None:
        """Take the generated tokens the matcher has not seen (replaying all of them when the
        sequence holds fewer than it took: a recompute dropped some)."""
        if len(output_token_ids) < self.num_accepted:
            self.matcher, self.num_accepted = self._new_matcher(), 0
        for token in output_token_ids[self.num_accepted:]:
            self.accept(token)

    def accept(self, token: int) -> None:
        self.num_accepted += 1
        if not self.matcher.is_terminated():
            self.matcher.accept_token(token)  # False (refused) only for a token it never allowed

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():  # done: only an end-of-sequence token may follow
            bitmask[row].zero_()
            for t in self._eos:
                bitmask[row, t // 32] |= _bit(t % 32)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_along(self, drafts: list[int], bitmask: torch.Tensor, first_row: int) -> None:
        """Masks for k + 1 positions: now, and after each drafted token (walking the matcher
        forward, then back). After a draft the grammar refuses, the later rows allow
        everything: the verifier rejects that draft, so they are never sampled from."""
        walked = 0
        for j in range(len(drafts) + 1):
            if j > 0 and (self.matcher.is_terminated() or not self.matcher.accept_token(drafts[j - 1])):
                bitmask[first_row + j:first_row + len(drafts) + 1] = -1
                break
            walked += j > 0
            self.fill(bitmask, first_row + j)
        if walked:
            self.matcher.rollback(walked)


def _bit(i: int) -> int:
    return (1 << i) - (1 << 32) if i == 31 else 1 << i  # an int32 word's bit i


def bitmask_for(num_rows: int, vocab_size: int) -> torch.Tensor:
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def fill_masks(states: list[GrammarState | None], vocab_size: int) -> torch.Tensor:
    """[rows, vocab] float32 bias (0 allowed, -inf refused); one row per state (None: nothing
    refused)."""
    bitmask = bitmask_for(len(states), vocab_size)
    for row, state in enumerate(states):
        if state is not None:
            state.fill(bitmask, row)
    return unpack_bias(bitmask, vocab_size)


class MaskPrefetch:
    """The next step's masks, computed on a helper thread while the model runs. A prefetch is
    used only when the step samples exactly the states it was computed for, each having taken
    no token since; anything else computes the masks in place."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[list, list[int], Future] | None = None

    def start(self, states: list[GrammarState | None], vocab_size: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="omniinfer-grammar")
        counts = [-1 if s is None else s.num_accepted for s in states]
        self._pending = (list(states), counts, self._pool.submit(fill_masks, states, vocab_size))

    def masks(self, states: list[GrammarState | None], vocab_size: int) -> torch.Tensor:
        pending, self._pending = self._pending, None
        if pending is not None:
            held, counts, future = pending
            result = future.result()  # (always waited for: the matchers are not thread-safe)
            if (len(held) == len(states) and all(a is b for a, b in zip(held, states))
                    and counts == [-1 if s is None else s.num_accepted for s in states]):
                return result
        return fill_masks(states, vocab_size)

    def join(self) -> None:
        """Let a pending prefetch finish (before anything else touches the matchers); what it
        computed stays usable while the matchers take no token."""
        if self._pending is not None:
            self._pending[2].exception()
