"""The output processor: tokens into text and `RequestOutput`s (V1's OutputProcessor).

After the scheduler has taken a model step's tokens (`Scheduler.update_from_output`), `process`
looks at the sequences whose requests watch every token: log-probabilities get their tokens'
text, and stop strings are checked as each token's text arrives (a hit cuts the text, ends the
sequence and drops any token after it). Everything else waits until the text is read:
`outputs` feeds each reported sequence's new tokens to its detokenizer then (every step for
streamed requests, once at the end for the others) and builds the outputs.

A failure tied to one request (its detokenizer, its stop handling) ends that request with an
error; the others go on. Its only calls into the scheduler: `end`, `truncate`, `fail_request`.
"""

from __future__ import annotations

import time

from omniinfer.engine.detokenizer import Detokenizers, find_stop
from omniinfer.engine.outputs import CompletionOutput, RequestOutput
from omniinfer.engine.schedule_outputs import StepUpdate
from omniinfer.engine.sequence import Sequence, SequenceGroup, SequenceStatus


class OutputProcessor:
    def __init__(self, tokenizer, scheduler, groups: dict[str, SequenceGroup]):
        self.tokenizer = tokenizer
        self.make_detokenizer = Detokenizers(tokenizer)
        self.scheduler = scheduler
        self.groups = groups  # the unfinished requests by id (the engine's)
        self.num_streamed = 0  # unfinished requests added with stream=True
        self.num_finished = 0

    def detokenizer(self, seq: Sequence):
        if seq.detok is None:
            group = seq.group
            seq.detok = self.make_detokenizer(group.prompt_token_ids, group.params.skip_special_tokens)
        return seq.detok

    # ---- each model step -----------------------------------------------------------------------
    def process(self, update: StepUpdate) -> None:
        """Log-probs and stop strings of the sequences that watch their tokens."""
        for seq, source, first, count in update.watched:
            if seq.group.error is None:
                try:
                    self._watch(seq, update, source, first, count)
                except Exception as e:  # noqa: BLE001 - this request's own failure
                    self.scheduler.fail_request(seq.group, e)

    def _watch(self, seq: Sequence, update: StepUpdate, source: int, first: int, count: int) -> None:
        out, p = update.output, seq.group.params
        lps, tops = out.logprobs.get(source), out.top_logprobs.get(source)
        start = len(seq.token_ids) - count  # the first of this step's tokens
        ended_by_token = seq.status == SequenceStatus.FINISHED_STOPPED  # at its last token
        for j in range(count):
            if lps is not None:
                seq.cumulative_logprob += lps[first + j]
                top = tops[first + j]
                if p.detokenize:
                    for tid, entry in top.items():
                        entry.decoded_token = self.tokenizer.decode([tid])
                if seq.output_logprobs is None:
                    seq.output_logprobs = []
                seq.output_logprobs.append(top)
            if not p.stop:
                continue
            num_tokens = start + j + 1
            new_text = self.detokenizer(seq).add(seq.token_ids[num_tokens - 1])
            seq.output_text += new_text
            seq.detok_pos = num_tokens
            if (new_text and num_tokens - seq.num_prompt_tokens >= p.min_tokens
                    and not (ended_by_token and j == count - 1)):
                hit = find_stop(seq.output_text, len(new_text), p.stop)
                if hit is not None:
                    index, stop = hit
                    end = index + len(stop) if p.include_stop_str_in_output else index
                    seq.output_text = seq.output_text[:end]
                    seq.stop_reason = stop
                    seq.detok_pos = None  # the text is final
                    self.scheduler.truncate(seq, num_tokens)
                    self.scheduler.end(seq, SequenceStatus.FINISHED_STOPPED)
                    return

    # ---- the step's outputs --------------------------------------------------------------------
    def outputs(self) -> list[RequestOutput]:
        """Outputs of the requests that finished this step and of the streamed ones that ran;
        finished requests are forgotten."""
        reported = self.scheduler.take_reported()
        if self.num_streamed:
            seen = {id(g) for g in reported}
            for s in self.scheduler.scheduled:
                group = s.seq.group
                if group.stream and id(group) not in seen:
                    seen.add(id(group))
                    reported.append(group)
        outputs, now = [], time.monotonic()
        for group in reported:
            if self.groups.get(group.request_id) is not group:  # aborted in the meantime
                continue
            if group.stream or group.is_finished:
                if group.stream and not group.is_finished:
                    group.metrics.last_token_time = now
                try:
                    outputs.append(self.output(group))
                except Exception as e:  # noqa: BLE001 - e.g. detokenising its text failed
                    self.scheduler.fail_request(group, e)
                    outputs.append(self.output(group))
            if group.is_finished:
                del self.groups[group.request_id]
                self.num_finished += 1
                self.num_streamed -= group.stream
        return outputs

    def _text(self, seq: Sequence) -> str:
        """The sequence's text so far: its detokenizer takes the tokens it has not seen."""
        pos = seq.detok_pos
        if pos is not None and seq.group.error is None and seq.group.params.detokenize:
            # (a failed request's text is not touched again; detokenize=False makes none)
            detok = self.detokenizer(seq)
            token_ids = seq.token_ids
            for token in token_ids[pos:]:
                detok.push(token)
            seq.detok_pos = len(token_ids)
            if seq.is_finished:
                seq.output_text += detok.flush()
                seq.detok_pos = None
            else:
                seq.output_text += detok.take()
        return seq.output_text

    def _decode_prompt_logprobs(self, group: SequenceGroup) -> None:
        """Each prompt log-prob's token text (`decoded_token`, as vLLM fills it), once all are in."""
        entries = group.prompt_logprobs
        if (not entries or not group.params.detokenize or len(entries) < len(group.prompt_token_ids)
                or next(iter(entries[-1].values())).decoded_token is not None):
            return
        for entry in entries[1:]:
            for tid, lp in entry.items():
                lp.decoded_token = self.tokenizer.decode([tid])

    def output(self, group: SequenceGroup) -> RequestOutput:
        holdback = max((len(s) for s in group.params.stop), default=1) - 1
        completions = []
        for seq in group.seqs:
            text = self._text(seq)
            if holdback and not seq.is_finished:  # might still become a stop string
                text = text[: max(0, len(text) - holdback)]
            completions.append(CompletionOutput(
                index=seq.index,
                text=text,
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.output_logprobs is not None else None,
                logprobs=seq.output_logprobs,
                finish_reason=seq.status.finish_reason,
                stop_reason=seq.stop_reason,
                error=group.error if seq.status == SequenceStatus.FINISHED_ERROR else None,
            ))
        completions.sort(key=lambda c: c.index)
        self._decode_prompt_logprobs(group)
        m = group.metrics
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=group.prompt_logprobs,
            outputs=completions,
            finished=group.is_finished,
            error=group.error,
            is_internal_error=group.is_internal_error,
            metrics={"arrival_time": m.arrival_time, "first_scheduled_time": m.first_scheduled_time,
                     "first_token_time": m.first_token_time, "last_token_time": m.last_token_time,
                     "finished_time": m.finished_time},
        )
