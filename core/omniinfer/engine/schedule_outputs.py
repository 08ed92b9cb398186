"""The scheduler's two conversions: a schedule into the workers' plain data (`describe`), and
what a model step produced back into sequence state (`update_from_output`).

Mixed into `Scheduler` (engine/scheduler.py), whose queues, block manager and records it uses;
kept apart so that the scheduling policy reads on its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from omniinfer.engine.sequence import Sequence, SequenceStatus
from omniinfer.step import ModelRunnerOutput, NewSeq, SchedulerOutput

if TYPE_CHECKING:
    from omniinfer.engine.scheduler import ScheduledSeq

_FINISHED = SequenceStatus.FINISHED_STOPPED


@dataclass(slots=True)
class StepUpdate:
    """What the output processor needs from one model step, after the scheduler took its tokens."""

    output: ModelRunnerOutput
    # sequences whose requests watch every token (stop strings, log-probs): (sequence, the seq_id
    # its tokens came under in `output`, index of its first token there, how many it took)
    watched: list[tuple[Sequence, int, int, int]] = field(default_factory=list)


class ScheduleOutputs:
    # ---- the schedule, as plain data -----------------------------------------------------------
    def describe(self, scheduled: Iterable[ScheduledSeq], out: SchedulerOutput) -> None:
        """Fill `out` for these sequences, in batch order: prefills, other decodes, then plain
        decodes (one token, sampling, no history to send, nothing else to do), each part in
        scheduling order."""
        prefills, decodes, plain = [], [], []
        for s in scheduled:
            seq = s.seq
            if s.num_new_tokens != 1 or seq.num_computed_tokens == 0:
                prefills.append(s)
            elif s.is_sampling and seq.group.decodes_plainly and not seq.group.reads_history:
                plain.append(s)
            else:
                decodes.append(s)
        self.scheduled = prefills + decodes + plain
        out.num_prefills = len(prefills)
        tables, k = self.blocks.tables, self.config.num_lookahead_slots
        window_tables = getattr(self.blocks, "window_tables", None)  # a window pool's (kv_groups.py)
        for s in prefills + decodes:
            self._describe_one(s, out, tables)
        seqs = [s.seq for s in plain]
        ids = [seq.seq_id for seq in seqs]
        out.seq_ids += ids
        out.token_ids += [seq.token_ids[-1] for seq in seqs]
        out.num_computed_tokens += [seq.num_computed_tokens for seq in seqs]
        out.block_tables += [tables[i] for i in ids]
        if window_tables is not None:
            out.window_block_tables = [window_tables[i] for i in out.seq_ids]
        out.num_scheduled_tokens += [1] * len(ids)
        out.num_samples += [1] * len(ids)
        if not self._sent.issuperset(ids) or not self._resend.isdisjoint(ids):
            for seq in seqs:
                self._send(seq, out)
        if k:
            out.spec_seq_ids = frozenset(s.seq.seq_id for s in self.scheduled if self._may_draft(s, k))
            for seq_id in out.spec_seq_ids:
                out.token_history[seq_id] = self.seqs[seq_id].token_ids
        if not out.is_empty:  # (an empty schedule never reaches the workers: keep them for later)
            out.finished_seq_ids, self._finished_ids = self._finished_ids, []

    def _describe_one(self, s: ScheduledSeq, out: SchedulerOutput, tables) -> None:
        seq, num_new = s.seq, s.num_new_tokens
        group, ctx = seq.group, seq.num_computed_tokens
        out.seq_ids.append(seq.seq_id)
        out.token_ids += seq.token_ids[ctx:ctx + num_new]
        out.num_computed_tokens.append(ctx)
        out.num_scheduled_tokens.append(num_new)
        out.block_tables.append(tables[seq.seq_id])
        forks = group.params.n > 1 and not group.is_forked
        out.num_samples.append(0 if not s.is_sampling else group.params.n if forks else 1)
        if group.wants_prompt_logprobs and not group.is_forked:
            out.prompt_logprobs[seq.seq_id] = len(group.prompt_logprobs or [None])
        if group.reads_history:
            out.token_history[seq.seq_id] = seq.token_ids
        self._send(seq, out)

    def _send(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Describe the sequence in full if the workers do not hold it (or hold a stale copy)."""
        seq_id = seq.seq_id
        if seq_id in self._sent and seq_id not in self._resend:
            return
        group = seq.group
        out.new_seqs.append(NewSeq(seq_id, group.request_id, seq.index, group.params,
                                   group.prompt_token_ids, group.eos_token_ids, group.grammar))
        self._sent.add(seq_id)
        self._resend.discard(seq_id)

    def _may_draft(self, s: ScheduledSeq, k: int) -> bool:
        """A decode with room for k drafted tokens under max_tokens and max_model_len."""
        seq, group = s.seq, s.seq.group
        return (s.num_new_tokens == 1 and s.is_sampling and seq.num_computed_tokens > 0
                and seq.num_computed_tokens == seq.num_tokens - 1
                and (group.params.n == 1 or group.is_forked)
                and seq.num_output_tokens + k + 1 <= group.max_tokens
                and seq.num_tokens + k <= self.config.max_model_len)

    # ---- after a model step ------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, output: ModelRunnerOutput) -> StepUpdate:
        """Take one model step's results (one of `sched.num_steps`): computed-token counts and
        prefix-cache hashes, the new tokens (appended; EOS, stop token ids, max_tokens and
        max_model_len end a sequence, and later tokens of an ended one are dropped), the fork of
        a request into its n samples, the failed requests, and the frees."""
        caching = self.blocks.pool.enable_caching
        running = SequenceStatus.RUNNING
        for s in self.scheduled:
            seq = s.seq
            if seq.status == running:
                seq.num_computed_tokens += s.num_new_tokens
                if caching:
                    self.blocks.cache_full_blocks(seq)
        update = StepUpdate(output)
        if output.num_drafted_seqs:
            self.spec_counts[0] += 1
            self.spec_counts[1] += output.num_draft_tokens
            self.spec_counts[2] += output.num_accepted_tokens
            self.spec_counts[3] += output.num_accepted_tokens + output.num_drafted_seqs
        seqs = self.seqs
        for seq_id, error in output.failed.items():
            if seq_id in seqs:
                self.fail_request(seqs[seq_id].group, error)
        for seq_id, (first, entries) in output.prompt_logprobs.items():
            group = seqs[seq_id].group if seq_id in seqs else None
            if group is not None:
                if group.prompt_logprobs is None:
                    group.prompt_logprobs = [None]
                if len(group.prompt_logprobs) == first:
                    group.prompt_logprobs += entries
        append = self._append
        for seq_id, tokens in zip(output.seq_ids, output.token_ids):
            seq = seqs.get(seq_id)
            if seq is None or seq.status >= _FINISHED:  # ended earlier (a run of steps), failed
                continue
            if len(tokens) == 1 and not seq.group.watches_tokens:  # the common case
                append(seq, tokens[0])
            elif len(tokens) == 1:
                append(seq, tokens[0])
                update.watched.append((seq, seq_id, 0, 1))
            else:
                self._append_several(seq, tokens, update)
        return update

    def _append_several(self, seq: Sequence, tokens: list[int], update: StepUpdate) -> None:
        group = seq.group
        watched = group.watches_tokens
        if group.params.n > 1 and not group.is_forked:  # the request's n first samples
            targets = [seq] + self._fork(seq, len(tokens))
            for k, target in enumerate(targets):
                self._append(target, tokens[k])
                if watched:
                    update.watched.append((target, seq.seq_id, k, 1))
            group.mark_forked()
            return
        num = 0  # speculative decoding: the accepted drafts, then the drawn token
        for token in tokens:
            num += 1
            if self._append(seq, token):
                break
        if watched:
            update.watched.append((seq, seq.seq_id, 0, num))
        if not seq.is_finished:  # the target cached the last known token and every accepted draft
            seq.num_computed_tokens += num - 1
            self.blocks.cache_full_blocks(seq)

    def _fork(self, parent: Sequence, n: int) -> list[Sequence]:
        children, after = [], parent
        for k in range(1, n):
            child = parent.fork(next(self._seq_ids), k)
            self.blocks.fork(parent, child)
            self.add_running(child, after=after)
            parent.group.seqs.append(child)
            children.append(child)
            after = child
        return children

    def _append(self, seq: Sequence, token: int) -> bool:
        """Append one token; True when it ended the sequence (which is then finished)."""
        token_ids = seq.token_ids
        token_ids.append(token)
        num_tokens = len(token_ids)
        if num_tokens % seq.block_size == 0:
            seq.extend_block_hashes()
        self.num_generation_tokens += 1
        group = seq.group
        p = group.params
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output == 1 and group.metrics.first_token_time is None:
            group.metrics.first_token_time = time.monotonic()
        status = None
        if num_output >= p.min_tokens:
            if not p.ignore_eos and token in group.eos_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
            elif token in p.stop_token_ids:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
        if status is None and (num_output >= group.max_tokens or num_tokens >= self.config.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is None:
            return False
        self.end(seq, status)
        return True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Drop the tokens after the first `num_tokens` (a stop string ended the sequence before
        the last accepted draft)."""
        self.num_generation_tokens -= len(seq.token_ids) - num_tokens
        del seq.token_ids[num_tokens:]
