"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

    step():  schedule  ->  execute on the workers  ->  append tokens, detokenize, stop

(With multi-step decoding one `step()` runs several decode steps and appends their tokens in
order.)

Everything before `execute` is plain Python over sequences and block ids; everything
vendor-specific sits behind the executor.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import time
from collections.abc import Iterable

from omniinfer.attention.selector import select_attention_backend
from omniinfer.config import EngineArgs, EngineConfig, dtype_name
from omniinfer.engine import request_checks
from omniinfer.engine.detokenizer import Detokenizers, find_stop
from omniinfer.engine.outputs import CompletionOutput, RequestOutput
from omniinfer.engine.scheduler import Scheduler, SchedulerOutput
from omniinfer.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from omniinfer.executor.base import executor_class
from omniinfer.logger import init_logger
from omniinfer.platforms.registry import get_registry
from omniinfer.sampling.params import SamplingParams
from omniinfer.sampling.sampler import SamplerOutput
from omniinfer.worker.model_input import ExecuteModelRequest

logger = init_logger(__name__)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    from omniinfer.quantization.gguf_file import is_gguf
    from omniinfer.quantization.gguf_file import load_tokenizer as gguf_tokenizer

    try:
        return gguf_tokenizer(path) if is_gguf(path) else AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ValueError(f"tokenizer={path!r} could not be loaded: {type(e).__name__}: {e}") from e


def torch_build(platform) -> str:
    import torch

    build = platform.build_info()
    return f"torch {torch.__version__}" + (f" ({build})" if build else "")


def _freeze_loaded_objects() -> None:
    """Everything loaded so far lives as long as the engine: move it out of the collector's way,
    so the collections a step's garbage triggers stay cheap (measured: 2.2 -> 2.0 ms per step at
    256 decodes). Unfrozen at exit, so objects that extension modules track are still freed."""
    global _unfreeze_registered
    gc.collect()
    gc.freeze()
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True


_unfreeze_registered = False


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True):
        self.config = config
        registry = get_registry()
        self.platform = registry.select_platform(config.device.device)
        reasons = self.platform.verify_config(config)
        if reasons:
            raise ValueError(f"platform {self.platform.name} cannot run this configuration: "
                             + "; ".join(reasons))
        m = config.model
        tp = config.parallel.tensor_parallel_size
        spec = self.platform.attention_spec(
            dtype=m.dtype, head_size=m.head_size, num_heads=m.num_heads // tp,
            num_kv_heads=max(1, m.num_kv_heads // tp), block_size=config.cache.block_size,
            sliding_window=m.sliding_window)
        self.attn_backend = select_attention_backend(self.platform, spec, registry.backends,
                                                     config.device.attention_backend)
        logger.info("platform %s (plugin %s %s), %s, devices: %s; attention backend %s; dtype %s",
                    self.platform.name, self.platform.plugin_name, self.platform.plugin_version,
                    torch_build(self.platform), ", ".join(self.platform.device_names()) or "-",
                    self.attn_backend.name, dtype_name(m.dtype))
        self.tokenizer = load_tokenizer(m.tokenizer)
        self.make_detokenizer = Detokenizers(self.tokenizer)
        self.eos_token_ids = list(m.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = [self.tokenizer.eos_token_id]
        self.executor = executor_class(config)(config, self.platform, self.attn_backend,
                                               progress=progress)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.executor.num_device_blocks,
                                   self.executor.num_host_blocks)
        self.proposer = None
        if config.speculative is not None:
            from omniinfer.spec_decode.proposer import DraftProposer, check_same_vocabulary

            check_same_vocabulary(self.tokenizer, config.speculative.draft.model)
            self.proposer = DraftProposer(config, self.platform, registry.backends,
                                          self.executor.num_device_blocks, progress=progress)
        _freeze_loaded_objects()
        self.groups: dict[str, SequenceGroup] = {}
        self._seq_ids = itertools.count()
        self.max_model_len = config.model.max_model_len
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_streamed = 0  # unfinished requests added with stream=True
        self.num_finished = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> LLMEngine:
        return cls(args.create_engine_config(), **kwargs)

    # ---- requests ------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: a string or {"prompt_token_ids": [...]}; checked."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one character or token")
            request_checks.check_text("prompt", prompt)
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), request_checks.token_ids(prompt, self.config.model.vocab_size)
        raise TypeError(f"prompt must be a string or a dict with 'prompt_token_ids', got "
                        f"{type(prompt).__name__}")

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Check a request of this many prompt tokens against the engine's limits (max_logprobs,
        max_num_seqs, the vocabulary, max_model_len, the KV cache); returns its resolved budget
        of generated tokens. Raises ValueError naming the field to blame."""
        request_checks.check_params(self.config, params)
        max_tokens = request_checks.resolve_max_tokens(self.config, num_prompt_tokens, params)
        request_checks.check_fits(self.scheduler, num_prompt_tokens, max_tokens, params)
        return max_tokens

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        return request_checks.resolve_max_tokens(self.config, num_prompt_tokens, params)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, stream: bool = True) -> None:
        """Queue a request. Raises ValueError/TypeError (and changes nothing) on bad input.

        With `stream=False`, `step()` returns this request's output only once it finishes
        (offline batches need nothing in between, and building outputs costs time)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a string, got {type(request_id).__name__}")
        if request_id in self.groups:
            raise ValueError(f"request_id={request_id!r} is already in use by an unfinished request")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize_prompt(prompt)
        max_tokens = self.check_request(len(ids), params)
        group = SequenceGroup(request_id, text, ids, params,
                              arrival_time=arrival_time or time.monotonic(),
                              max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                              stream=stream)
        seq = Sequence(next(self._seq_ids), group, 0, list(ids), len(ids), self.config.cache.block_size)
        seq.detok = self.make_detokenizer(ids, params.skip_special_tokens)
        group.seqs.append(seq)
        self.groups[request_id] = group
        self.num_streamed += stream
        self.scheduler.add(seq)
        self.num_prompt_tokens += len(ids)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests and free everything they hold; unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            self.num_streamed -= group.stream
            for seq in group.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                if self.proposer is not None:
                    self.proposer.forget(seq.seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the requests that progressed or finished."""
        sched = self.scheduler.schedule()
        touched: dict[str, SequenceGroup] = {}  # requests to report: streamed or finished
        self._touched = touched
        for seq in sched.rejected:
            self._finish_group_with_error(seq.group)
            touched[seq.request_id] = seq.group
        if not sched.is_empty:
            if self.proposer is not None:
                self.proposer.propose(sched, self.scheduler.blocks.tables)
            results = self.executor.execute_model(self._request(sched))
            for result in results:  # one per decode step (several with multi-step decoding)
                self.scheduler.update_after_step(sched)
                self._process(sched, result, touched)
            if self.proposer is not None:
                self.proposer.after_step(sched, results[0])
        outputs = []
        for group in list(touched.values()):
            if group.stream or group.is_finished:
                try:
                    outputs.append(self._output(group))
                except Exception as e:  # noqa: BLE001 - e.g. detokenising its text failed
                    self._fail_request(group, e)
                    outputs.append(self._output(group))
        for group in touched.values():
            if group.is_finished and self.groups.pop(group.request_id, None) is not None:
                self.num_finished += 1
                self.num_streamed -= group.stream
        return outputs

    def _request(self, sched: SchedulerOutput) -> ExecuteModelRequest:
        return ExecuteModelRequest(sched.scheduled, self.scheduler.blocks.tables,
                                   sched.blocks_to_swap_in, sched.blocks_to_swap_out,
                                   sched.blocks_to_copy, sched.num_steps)

    def _process(self, sched: SchedulerOutput, result: SamplerOutput,
                 touched: dict[str, SequenceGroup]) -> None:
        # A failure tied to one request (its sampling, detokenisation, stop handling) ends that
        # request with an error; the others go on. Try blocks cost nothing unless they catch.
        now = time.monotonic()
        for request_id, error in result.failed.items():
            self._fail_request(self.groups[request_id], error)
        for request_id, (first, entries) in result.prompt_logprobs.items():
            group = self.groups[request_id]
            if group.prompt_logprobs is None:
                group.prompt_logprobs = [None]
            if len(group.prompt_logprobs) == first:
                group.prompt_logprobs += entries
        if result.greedy is not None:  # one greedy token per sequence, nothing else
            for seq, token in zip(*result.greedy):
                if seq.status < SequenceStatus.FINISHED_STOPPED:
                    try:
                        self._append(seq, token, None, None)
                    except Exception as e:  # noqa: BLE001 - this request's own failure
                        self._fail_request(seq.group, e)
        samples = result.samples
        if not samples and not self.num_streamed:  # the greedy fast path covered everything
            return
        for s in sched.scheduled:
            seq = s.seq
            group = seq.group
            if group.stream:  # streamed requests report every step (finished ones always do)
                touched[group.request_id] = group
                group.metrics.last_token_time = now
            sample = samples.get(seq.seq_id)
            if sample is None or seq.status >= SequenceStatus.FINISHED_STOPPED:
                continue
            try:
                self._apply_sample(s, sample)
            except Exception as e:  # noqa: BLE001 - this request's own failure
                self._fail_request(group, e)

    def _apply_sample(self, s, sample) -> None:
        seq, group = s.seq, s.seq.group
        token_ids = sample.token_ids
        if len(token_ids) == 1 and sample.logprobs is None:  # one token, nothing else
            self._append(seq, token_ids[0], None, None)
            return
        if s.spec_tokens:  # several tokens for one sequence: accepted drafts + one drawn
            self._append_speculative(seq, sample)
            return
        targets = [seq]
        if len(sample.token_ids) > 1 and not group.is_forked:
            targets += self._fork(seq, len(sample.token_ids))
        for k, target in enumerate(targets):
            lp = None if sample.logprobs is None else sample.logprobs[k]
            top = None if sample.top_logprobs is None else sample.top_logprobs[k]
            self._append(target, sample.token_ids[k], lp, top)
        if group.params.n > 1 and not group.is_forked:
            group.mark_forked()

    def _append_speculative(self, seq: Sequence, sample) -> None:
        for j, token in enumerate(sample.token_ids):
            lp = None if sample.logprobs is None else sample.logprobs[j]
            top = None if sample.top_logprobs is None else sample.top_logprobs[j]
            self._append(seq, token, lp, top)
            if seq.is_finished:
                return
        # the target cached the last known token and every accepted draft
        self.scheduler.advance_computed(seq, len(sample.token_ids) - 1)

    def _fork(self, parent: Sequence, n: int) -> list[Sequence]:
        children = []
        after = parent
        for k in range(1, n):
            child = parent.fork(next(self._seq_ids), k)
            child.detok = self.make_detokenizer(parent.group.prompt_token_ids,
                                                parent.group.params.skip_special_tokens)
            self.scheduler.blocks.fork(parent, child)
            self.scheduler.add_running(child, after=after)
            parent.group.seqs.append(child)
            children.append(child)
            after = child
        return children

    def _append(self, seq: Sequence, token: int, logprob: float | None, top) -> None:
        group = seq.group
        p = group.params
        metrics = group.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = time.monotonic()
        token_ids = seq.token_ids
        token_ids.append(token)
        num_tokens = len(token_ids)
        if num_tokens % seq.block_size == 0:
            seq.extend_block_hashes()
        self.num_generation_tokens += 1
        if logprob is not None:
            seq.cumulative_logprob += logprob
            if seq.output_logprobs is None:
                seq.output_logprobs = []
            for tid, entry in top.items():
                entry.decoded_token = self.tokenizer.decode([tid])
            seq.output_logprobs.append(top)
        if p.stop:  # the text is checked now
            new_text = seq.detok.add(token)
            seq.output_text += new_text
        else:  # the text is wanted only when read (`_output`)
            seq.detok.push(token)
            new_text = ""
        status = None
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= p.min_tokens:
            if not p.ignore_eos and token in group.eos_token_ids:
                status = SequenceStatus.FINISHED_STOPPED
            elif token in p.stop_token_ids:
                status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token
            elif new_text:
                hit = find_stop(seq.output_text, len(new_text), p.stop)
                if hit is not None:
                    index, stop = hit
                    end = index + len(stop) if p.include_stop_str_in_output else index
                    seq.output_text = seq.output_text[:end]
                    status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        if status is None and (num_output >= group.max_tokens or num_tokens >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is not None:
            if not isinstance(seq.stop_reason, str):  # a stop string cut the text already
                seq.output_text += seq.detok.flush()
            self.scheduler.finish(seq, status)
            metrics.finished_time = metrics.last_token_time = time.monotonic()
            self._touched[group.request_id] = group

    def _fail_request(self, group: SequenceGroup, error: BaseException | str) -> None:
        """End a request whose own processing failed in a step: it reports the error, its
        blocks are freed, the rest of the batch goes on."""
        if group.error is None:
            cause = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            group.error = f"the request failed inside the engine: {cause}"
            group.is_internal_error = True
            if not isinstance(error, str):
                logger.error("request %s failed in a step", group.request_id, exc_info=error)
        self._finish_group_with_error(group)
        self._touched[group.request_id] = group

    def _finish_group_with_error(self, group: SequenceGroup) -> None:
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ERROR)
        logger.warning("request %s finished with an error: %s", group.request_id, group.error)

    # ---- outputs ---------------------------------------------------------------------------------------
    def _output(self, group: SequenceGroup) -> RequestOutput:
        finished = group.is_finished
        holdback = max((len(s) for s in group.params.stop), default=1) - 1
        completions = []
        for seq in group.seqs:
            if group.error is None:  # a failed request's detokenizer is not touched again
                seq.output_text += seq.detok.take()
            text = seq.output_text
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
        m = group.metrics
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=group.prompt_logprobs,
            outputs=completions,
            finished=finished,
            error=group.error,
            is_internal_error=group.is_internal_error,
            metrics={"arrival_time": m.arrival_time, "first_scheduled_time": m.first_scheduled_time,
                     "first_token_time": m.first_token_time, "last_token_time": m.last_token_time,
                     "finished_time": m.finished_time},
        )

    # ---- introspection ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = self.scheduler.stats()
        out.update(num_prompt_tokens=self.num_prompt_tokens,
                   num_generation_tokens=self.num_generation_tokens,
                   num_finished_requests=self.num_finished)
        if self.proposer is not None:
            out.update(self.proposer.stats())
        return out

    def shutdown(self) -> None:
        """Stop the workers (processes, Ray actors) and leave the process groups; idempotent."""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter teardown: the atexit hook covers it
            self.shutdown()
