"""Continuous batching over the paged KV cache, counting tokens rather than modes.

Every step the scheduler hands out a token budget (`max_num_batched_tokens`): first to
running sequences that decode (one token each), then to running sequences still in their
prompt, then to waiting sequences in arrival order. A sequence scheduled for fewer tokens
than it has left is being prefilled in chunks; only the step that reaches its last token
samples. When blocks run out, the most recently arrived running sequence is preempted
(recomputed later, or swapped to host memory).

Multi-step decoding (`num_scheduler_steps` > 1): when every running sequence decodes and
nothing else could start, one scheduling step reserves the KV slots of several decode steps
and the workers run them back to back; `update_from_output` then takes their tokens in order.

The workers see none of this: `schedule()` describes the step as plain data (a
`SchedulerOutput`, omniinfer/step.py) and `update_from_output` reads plain data back (a
`ModelRunnerOutput`): it appends the tokens, stops sequences on EOS, stop token ids,
`max_tokens` and `max_model_len`, advances computed-token counts, forks a request into its n
samples, and frees what finished. Text (detokenisation, stop strings) is the output
processor's (engine/output_processor.py).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from omniinfer.config import CacheConfig, SchedulerConfig
from omniinfer.engine.block_manager import BlockManager
from omniinfer.engine.kv_groups import HybridBlockManager
from omniinfer.engine.schedule_outputs import ScheduleOutputs
from omniinfer.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from omniinfer.kv_window import max_step_tokens
from omniinfer.logger import init_logger
from omniinfer.step import SchedulerOutput

logger = init_logger(__name__)


@dataclass(slots=True)
class ScheduledSeq:
    """The scheduler's own record of one sequence it scheduled (engine side only)."""

    seq: Sequence
    num_new_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens
    is_sampling: bool = field(init=False)  # reaches the last known token, so samples

    def __post_init__(self) -> None:
        seq = self.seq
        self.is_sampling = seq.num_computed_tokens + self.num_new_tokens >= len(seq.token_ids)


class Scheduler(ScheduleOutputs):
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_device_blocks: int, num_host_blocks: int,
                 window_pool: tuple[int, int] | None = None, prompt_logprob_rows: int | None = None):
        """`window_pool`: (window, blocks) of the sliding layers' own pool (engine/kv_groups.py).
        `prompt_logprob_rows`: with chunked prefill, the most prompt tokens owed log-probs one
        step computes, all sequences together (each is a row of logits; None: the step's budget)."""
        self.config = scheduler_config
        self.prompt_logprob_rows = prompt_logprob_rows if scheduler_config.enable_chunked_prefill else None
        self._rows_left: int | None = None  # this step's, while it is scheduled
        self.block_size = cache_config.block_size
        if window_pool is None:
            self.blocks = BlockManager(cache_config.block_size, num_device_blocks, num_host_blocks,
                                       cache_config.enable_prefix_caching)
        else:
            window, num_window_blocks = window_pool
            self.blocks = HybridBlockManager(
                cache_config.block_size, num_device_blocks, num_window_blocks, window,
                cache_config.enable_prefix_caching, max_step_tokens(scheduler_config))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.seqs: dict[int, Sequence] = {}  # every unfinished sequence by id
        self.scheduled: list[ScheduledSeq] = []  # the last schedule, in the workers' batch order
        self._seq_ids = itertools.count()
        # the workers' view: the sequences they hold state for, the ones whose state is stale
        # (preempted: sent again as new), the ones to forget at the next step
        self._sent: set[int] = set()
        self._resend: set[int] = set()
        self._finished_ids: list[int] = []
        self._reported: dict[str, SequenceGroup] = {}  # requests with news for their caller
        self.num_generation_tokens = 0
        self.spec_counts = [0, 0, 0, 0]  # draft steps, drafted, accepted and emitted tokens

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, group: SequenceGroup) -> Sequence:
        """Queue a new request: its first sequence waits."""
        seq = Sequence(next(self._seq_ids), group, 0, list(group.prompt_token_ids),
                       len(group.prompt_token_ids), self.block_size)
        group.seqs.append(seq)
        self.add(seq)
        return seq

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def add_running(self, seq: Sequence, after: Sequence) -> None:
        """A forked child runs right after its parent (same arrival)."""
        seq.status = SequenceStatus.RUNNING
        self.seqs[seq.seq_id] = seq
        self.running.insert(self.running.index(after) + 1, seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of every queue and free its blocks (no-op if already out). Its
        request is reported at the end of the step, unless it was aborted."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        seq.status = status
        self.blocks.free(seq)
        if self.seqs.pop(seq.seq_id, None) is not None and seq.seq_id in self._sent:
            self._sent.discard(seq.seq_id)
            self._resend.discard(seq.seq_id)
            self._finished_ids.append(seq.seq_id)
        if status != SequenceStatus.FINISHED_ABORTED:
            self._reported[seq.group.request_id] = seq.group

    def end(self, seq: Sequence, status: SequenceStatus) -> None:
        """Finish a sequence that its own tokens ended (a stop, its length), with the time."""
        self.finish(seq, status)
        metrics = seq.group.metrics
        metrics.finished_time = metrics.last_token_time = time.monotonic()

    def fail_request(self, group: SequenceGroup, error: BaseException | str,
                     is_internal: bool = True) -> None:
        """End a request with an error: it reports it, its blocks are freed, the rest of the batch
        goes on. `is_internal`: the engine failed processing it inside a step (its sampling,
        its text), rather than the request being impossible."""
        if group.error is None:
            cause = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            group.error = f"the request failed inside the engine: {cause}" if is_internal else cause
            group.is_internal_error = is_internal
            if not isinstance(error, str):
                logger.error("request %s failed in a step", group.request_id, exc_info=error)
        for seq in group.seqs:
            if not seq.is_finished:
                self.finish(seq, SequenceStatus.FINISHED_ERROR)
        self._reported[group.request_id] = group
        logger.warning("request %s finished with an error: %s", group.request_id, group.error)

    def take_reported(self) -> list[SequenceGroup]:
        """The requests that finished (or failed) since the last call, each once; the output
        processor adds the streamed ones that ran."""
        reported, self._reported = list(self._reported.values()), {}
        return reported

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ---- one step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """This step's batch, as the workers' plain data (`self.scheduled` keeps the sequences)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        lookahead = self.config.num_lookahead_slots  # drafted tokens: scored in the same pass
        out.num_steps = self._decode_steps()
        ahead = max(lookahead, out.num_steps - 1)  # slots reserved past a decode's token
        scheduled: dict[int, ScheduledSeq] = {}
        self._copies: dict[int, list[tuple[int, int]]] = {}  # this step's copy-on-writes per seq
        self._num_preempted = 0
        self._rows_left = self.prompt_logprob_rows
        decodes, prefills = [], []
        for s in self.running:
            (decodes if len(s.token_ids) - s.num_computed_tokens == 1 else prefills).append(s)
        running = SequenceStatus.RUNNING
        has_room = self.blocks.has_room
        bounded = self._rows_left is not None  # (looked at once a sequence: this loop is hot)
        for seq in decodes + prefills:
            if seq.status != running:  # preempted earlier in this loop
                continue
            group = seq.group
            owed = bounded and group.params.prompt_logprobs is not None and group.wants_prompt_logprobs
            left = len(seq.token_ids) - seq.num_computed_tokens
            num_new = min(left, budget, self._rows_left) if owed else min(left, budget)
            if num_new <= 0:
                continue
            slots = num_new + (ahead if num_new == 1 else 0)
            cost = num_new + (lookahead if num_new == 1 else 0)  # tokens of this pass
            if has_room(seq, slots):  # the common decode: nothing to allocate
                scheduled[seq.seq_id] = ScheduledSeq(seq, num_new)
                budget -= cost
                if owed:
                    self._rows_left -= num_new
                continue
            while not self._allocate(seq, slots):
                victim = self._pick_victim(seq)
                if victim is seq:
                    self._preempt(seq, out)
                    break
                if victim.seq_id in scheduled:
                    given = scheduled.pop(victim.seq_id).num_new_tokens
                    budget += given + (lookahead if given == 1 else 0)
                    self._take_rows(victim, -given)
                self._preempt(victim, out)
            else:
                scheduled[seq.seq_id] = ScheduledSeq(seq, num_new)
                budget -= cost
                if owed:
                    self._rows_left -= num_new

        if self._num_preempted == 0:
            budget = self._schedule_swapped(out, scheduled, budget)
        if self._num_preempted == 0 and not self.swapped:
            self._schedule_waiting(scheduled, budget)
        out.blocks_to_copy = [c for copies in self._copies.values() for c in copies]
        if isinstance(self.blocks, HybridBlockManager):
            out.window_blocks_to_copy, self.blocks.window_copies = self.blocks.window_copies, []
        self.describe(scheduled.values(), out)
        now = time.monotonic()
        for s in self.scheduled:
            if s.num_new_tokens != 1 or s.seq.num_computed_tokens == 0:  # decodes were seen before
                metrics = s.seq.group.metrics
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = now
        return out

    def _decode_steps(self) -> int:
        """Decode steps to run on this schedule: `num_scheduler_steps`, or fewer so that no
        sequence passes max_tokens or max_model_len, when every running sequence decodes with
        nothing between its steps (see `SequenceGroup.decodes_ahead`), no waiting or swapped
        sequence could start, and the free blocks hold every step; otherwise 1."""
        steps = self.config.num_scheduler_steps
        if steps == 1 or not self.running or self.swapped or (
                self.waiting and len(self.running) < self.config.max_num_seqs):
            return 1
        max_len = self.config.max_model_len
        for seq in self.running:
            num_tokens = len(seq.token_ids)
            num_output = num_tokens - seq.num_prompt_tokens
            if num_tokens - seq.num_computed_tokens != 1 or not seq.group.decodes_ahead(num_output):
                return 1
            steps = min(steps, seq.group.max_tokens - num_output, max_len - num_tokens)
        if steps <= 1:
            return 1
        return steps if self.blocks.can_grow(self.running, steps) else 1

    def _allocate(self, seq: Sequence, num_tokens: int, computed: list[int] | None = None) -> bool:
        copies: list[tuple[int, int]] = []
        ok = self.blocks.allocate_slots(seq, num_tokens, computed=computed, copies=copies)
        if copies:
            self._copies.setdefault(seq.seq_id, []).extend(copies)
        return ok

    def _pick_victim(self, seq: Sequence) -> Sequence:
        """The running sequence that arrived last (possibly `seq` itself)."""
        for victim in reversed(self.running):
            if victim.status == SequenceStatus.RUNNING:
                return victim
        return seq

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._num_preempted += 1
        self.num_preemptions += 1
        seq.num_preemptions += 1
        if seq.seq_id in self._sent:  # what the workers hold for it (a draft's cache) is stale
            self._resend.add(seq.seq_id)
        # A copy-on-write made for this sequence earlier in the step will not run; swap out
        # from its source instead (the worker swaps out before it copies).
        undo = {dst: src for src, dst in self._copies.pop(seq.seq_id, [])}
        if self.config.preemption_mode == "swap" and self.blocks.can_swap_out(seq):
            out.blocks_to_swap_out += [(undo.get(d, d), h) for d, h in self.blocks.swap_out(seq)]
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _schedule_swapped(self, out: SchedulerOutput, scheduled: dict[int, ScheduledSeq],
                          budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            num_new = self._grant(seq, seq.num_tokens - seq.num_computed_tokens, budget)
            extra = self.config.num_lookahead_slots if num_new == 1 else 0
            if num_new <= 0 or not self.blocks.can_swap_in(seq, num_new + extra):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += self.blocks.swap_in(seq)
            ok = self._allocate(seq, num_new + extra)
            assert ok, "can_swap_in promised room"
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = ScheduledSeq(seq, num_new)
            budget -= num_new + extra
            self._take_rows(seq, num_new)
        return budget

    def _schedule_waiting(self, scheduled: dict[int, ScheduledSeq], budget: int) -> None:
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            reason = self._never_fits(seq)
            if reason:
                self.waiting.popleft()
                self.fail_request(seq.group, reason, is_internal=False)
                continue
            computed = [] if seq.group.wants_prompt_logprobs else self.blocks.computed_prefix(seq)
            seq.num_computed_tokens = len(computed) * self.block_size
            remaining = seq.num_tokens - seq.num_computed_tokens
            if not chunked and remaining > budget:
                seq.num_computed_tokens = 0
                break
            num_new = self._grant(seq, remaining, budget)
            if num_new <= 0 or not self._allocate(seq, num_new, computed):
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled[seq.seq_id] = ScheduledSeq(seq, num_new)
            budget -= num_new
            self._take_rows(seq, num_new)

    def _grant(self, seq: Sequence, left: int, budget: int) -> int:
        """Tokens `seq` gets of the `left` it has: what the step's budget holds, and for a prompt
        owed log-probs what its rows of logits left this step hold (`prompt_logprob_rows`)."""
        if self._rows_left is not None and seq.group.wants_prompt_logprobs:
            return min(left, budget, self._rows_left)
        return min(left, budget)

    def _take_rows(self, seq: Sequence, num_new: int) -> None:
        """Count a prompt owed log-probs against this step's rows (negative: give them back)."""
        if self._rows_left is not None and seq.group.wants_prompt_logprobs:
            self._rows_left -= num_new

    def _never_fits(self, seq: Sequence) -> str | None:
        return self.never_fits(seq.num_prompt_tokens, seq.group.max_tokens)

    def never_fits(self, num_prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of this size could never be scheduled, or None."""
        most = num_prompt_tokens + max_tokens + self.config.num_lookahead_slots
        short = self.blocks.blocks_short(min(most, self.config.max_model_len + self.config.num_lookahead_slots))
        if short:
            return (f"the request needs up to {short[0]} KV-cache blocks ({most} tokens of "
                    f"{self.block_size}) but the cache has only {short[1]} "
                    "blocks; raise num_kv_blocks / kv_cache_memory_bytes or lower max_tokens")
        if not self.config.enable_chunked_prefill and num_prompt_tokens > self.config.max_num_batched_tokens:
            return (f"a prompt of {num_prompt_tokens} tokens exceeds max_num_batched_tokens="
                    f"{self.config.max_num_batched_tokens} with chunked prefill disabled")
        return None

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> dict:
        # requests (a request with n = 3 is one) where any sequence runs, else is swapped, else waits
        running = {id(s.group) for s in self.running}
        swapped = {id(s.group) for s in self.swapped} - running
        waiting = {id(s.group) for s in self.waiting} - running - swapped
        return {
            "num_running": len(self.running),  # sequences
            "num_waiting": len(self.waiting),
            "num_swapped": len(self.swapped),
            "num_running_requests": len(running),
            "num_waiting_requests": len(waiting),
            "num_swapped_requests": len(swapped),
            "num_preemptions": self.num_preemptions,
            "num_total_kv_blocks": self.blocks.num_total_blocks,
            "num_free_kv_blocks": self.blocks.num_free_blocks,
            "kv_cache_usage": self.blocks.usage,
            "prefix_cache_hit_rate": self.blocks.prefix_cache_hit_rate,
            "num_prefix_cache_queries": self.blocks.pool.num_queries,  # full blocks looked up
            "num_prefix_cache_hits": self.blocks.pool.num_hits,
        }
