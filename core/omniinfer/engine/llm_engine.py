"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

    step():  schedule  ->  execute on the workers  ->  update the sequences  ->  outputs

The scheduler turns its queues into plain data for the workers (`SchedulerOutput`) and takes
plain data back (`ModelRunnerOutput`: tokens per sequence); the output processor makes the
text. (With multi-step decoding one `step()` runs several decode steps and takes their tokens
in order.) Everything vendor-specific, speculative drafting included, sits behind the executor.
"""

from __future__ import annotations

import atexit
import gc
import time
from collections.abc import Iterable

from omniinfer.attention.selector import backend_for_model
from omniinfer.config import EngineArgs, EngineConfig, dtype_name
from omniinfer.engine import request_checks
from omniinfer.engine.output_processor import OutputProcessor
from omniinfer.engine.outputs import RequestOutput
from omniinfer.engine.scheduler import Scheduler
from omniinfer.engine.sequence import SequenceGroup, SequenceStatus
from omniinfer.executor.base import executor_class
from omniinfer.heap import release_freed_memory
from omniinfer.kv_window import window_pool_plan, window_pool_refusal
from omniinfer.logger import init_logger
from omniinfer.platforms.registry import get_registry
from omniinfer.sampling.params import SamplingParams
from omniinfer.structured.engine import compile_grammar

logger = init_logger(__name__)


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    from omniinfer.quantization.gguf_file import is_gguf
    from omniinfer.quantization.gguf_tokenizer import load_tokenizer as gguf_tokenizer

    try:
        return (gguf_tokenizer(path) if is_gguf(path) else
                AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code))
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
    release_freed_memory()  # (what loading freed: the tokenizer's conversion, the loader's buffers)
    if not _unfreeze_registered:
        atexit.register(gc.unfreeze)
        _unfreeze_registered = True


_unfreeze_registered = False


def prompt_logprob_rows(platform, config: EngineConfig) -> int | None:
    """The most prompt tokens owed log-probs one step computes (`Platform.prompt_logits_bytes`
    over a float32 row of the vocabulary; at least 16), or None where that bound is no tighter
    than the step's token budget."""
    limit = platform.prompt_logits_bytes()
    if limit is None:
        return None
    rows = max(16, limit // (4 * config.model.vocab_size))
    if rows >= config.scheduler.max_num_batched_tokens:
        return None
    logger.info("prompt log-probs: at most %d prompt tokens a step (%d MiB of float32 logits for "
                "a %d-token vocabulary)", rows, limit >> 20, config.model.vocab_size)
    return rows


def _platform_dtype(platform, config: EngineConfig) -> None:
    """dtype="auto": the checkpoint's dtype, unless the platform runs another better
    (`Platform.auto_dtype`: the CPU runs a float16 checkpoint in bfloat16)."""
    m = config.model
    if not m.dtype_is_auto:
        return
    dtype = platform.auto_dtype(m.dtype)
    if dtype != m.dtype:
        logger.info("the checkpoint is %s; platform %s runs it in %s (dtype='auto'; pass dtype=%r "
                    "to keep it)", dtype_name(m.dtype), platform.name, dtype_name(dtype), dtype_name(m.dtype))
        m.dtype = dtype
        if config.speculative is not None:
            config.speculative.draft.dtype = dtype


class LLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True):
        self.config = config
        registry = get_registry()
        self.platform = registry.select_platform(config.device.device)
        _platform_dtype(self.platform, config)
        reasons = self.platform.verify_config(config)
        if reasons:
            raise ValueError(f"platform {self.platform.name} cannot run this configuration: "
                             + "; ".join(reasons))
        m = config.model
        self.attn_backend = backend_for_model(self.platform, m, config,
                                              config.parallel.tensor_parallel_size)
        logger.info("platform %s (plugin %s %s), %s, devices: %s; attention backend %s; dtype %s",
                    self.platform.name, self.platform.plugin_name, self.platform.plugin_version,
                    torch_build(self.platform), ", ".join(self.platform.device_names()) or "-",
                    self.attn_backend.name, dtype_name(m.dtype))
        self.tokenizer = load_tokenizer(m.tokenizer, m.trust_remote_code)
        if config.speculative is not None:
            from omniinfer.spec_decode.proposer import check_same_vocabulary

            check_same_vocabulary(self.tokenizer, config.speculative.draft.model)
        self.eos_token_ids = list(m.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids = [self.tokenizer.eos_token_id]
        self.executor = executor_class(config)(config, self.platform, self.attn_backend,
                                               progress=progress)
        window_pool = window_pool_plan(config, self.attn_backend, self.executor.num_device_blocks)
        if window_pool is not None:
            logger.info("sliding-window layers keep only their window: a pool of %d blocks beside "
                        "the full layers' %d", window_pool[1], self.executor.num_device_blocks)
        elif len(set(m.layer_windows)) > 1:
            logger.info("sliding-window layers keep every block: %s",
                        window_pool_refusal(config, self.attn_backend))
        self.scheduler = Scheduler(config.scheduler, config.cache, self.executor.num_device_blocks,
                                   self.executor.num_host_blocks, window_pool,
                                   prompt_logprob_rows(self.platform, config))
        self.groups: dict[str, SequenceGroup] = {}  # the unfinished requests
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler, self.groups)
        _freeze_loaded_objects()
        self.max_model_len = config.model.max_model_len
        self.num_prompt_tokens = 0
        self.last_step_tokens = (0, 0)  # tokens the last step computed per forward pass, passes

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> LLMEngine:
        return cls(args.create_engine_config(), **kwargs)

    # ---- requests ------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt, params: SamplingParams | None = None) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt, checked: a string, {"prompt": text} or
        {"prompt_token_ids": [...]} (vLLM's TextPrompt and TokensPrompt; with both keys the ids
        are what runs and the text is what outputs report). `params.truncate_prompt_tokens`
        keeps the last k ids."""
        text, ids = self._tokenize_prompt(prompt)
        keep = params.truncate_prompt_tokens if params is not None else None
        return text, (ids[-keep:] if keep is not None else ids)

    def _tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = sorted(map(repr, set(prompt) - {"prompt", "prompt_token_ids"}))
            if unknown:
                raise ValueError(f"prompt holds the key(s) {', '.join(unknown)}; allowed: 'prompt' "
                                 "(text) and 'prompt_token_ids' (this engine runs text models)")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), request_checks.token_ids(prompt, self.config.model.vocab_size)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise TypeError(f"prompt['prompt'] must be a string, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one character or token")
            request_checks.check_text("prompt", prompt)
            return prompt, list(self.tokenizer(prompt).input_ids)
        raise TypeError(f"prompt must be a string, {{'prompt': text}} or {{'prompt_token_ids': [...]}}, "
                        f"got {type(prompt).__name__}{' without either key' if isinstance(prompt, dict) else ''}")

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Check a request of this many prompt tokens against the engine's limits (max_logprobs,
        max_num_seqs, the vocabulary, max_model_len, the KV cache); returns its resolved budget
        of generated tokens. Raises ValueError naming the field to blame. A prompt that
        `params.truncate_prompt_tokens` cuts is counted as cut."""
        if params.truncate_prompt_tokens is not None:
            num_prompt_tokens = min(num_prompt_tokens, params.truncate_prompt_tokens)
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
        text, ids = self.tokenize_prompt(prompt, params)
        max_tokens = self.check_request(len(ids), params)
        if params.bad_words:
            params.bad_words_token_ids = request_checks.bad_words_token_ids(
                self.tokenizer, params.bad_words, self.config.model.vocab_size)
        grammar = compile_grammar(self, params)
        group = SequenceGroup(request_id, text, ids, params, grammar=grammar,
                              arrival_time=arrival_time or time.monotonic(),
                              max_tokens=max_tokens, eos_token_ids=self.eos_token_ids,
                              stream=stream)
        self.groups[request_id] = group
        self.output_processor.num_streamed += stream
        self.scheduler.add_request(group)
        self.num_prompt_tokens += len(ids)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests and free everything they hold; unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            self.output_processor.num_streamed -= group.stream
            for seq in group.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step: schedule -> execute -> update -> outputs. Returns the requests
        that finished, and the streamed ones that progressed."""
        sched = self.scheduler.schedule()
        results = [] if sched.is_empty else self.executor.execute_model(sched)
        self.last_step_tokens = (sum(sched.num_scheduled_tokens), len(results))
        for result in results:  # one per decode step (several with multi-step decoding)
            self.output_processor.process(self.scheduler.update_from_output(sched, result))
        outputs = self.output_processor.outputs()  # (forgets the finished requests)
        if results and not self.groups:  # idle now: what the steps freed goes back
            self.executor.release_idle_memory()
        return outputs

    # ---- introspection ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = self.scheduler.stats()
        out.update(num_prompt_tokens=self.num_prompt_tokens,
                   num_generation_tokens=self.scheduler.num_generation_tokens,
                   num_finished_requests=self.output_processor.num_finished)
        if self.config.speculative is not None:
            steps, proposed, accepted, emitted = self.scheduler.spec_counts
            out.update(num_spec_proposed_tokens=proposed, num_spec_accepted_tokens=accepted,
                       num_spec_emitted_tokens=emitted,
                       spec_acceptance_rate=accepted / proposed if proposed else 0.0,
                       num_spec_draft_steps=steps)
        return out

    def shutdown(self) -> None:
        """Stop the workers (processes, Ray actors) and leave the process groups; idempotent.
        (What loading froze stays frozen: unfreezing here made every later engine's start a
        collection of everything, +9 s over 100 tests. The model is freed by reference counting,
        which tests/test_heap.py holds to.)"""
        executor = getattr(self, "executor", None)
        if executor is not None:
            executor.shutdown()

    def __del__(self):
        # No module globals here (contextlib, ...): collected during interpreter teardown, as an
        # object in a reference cycle is, they may already be None. The atexit hook has shut
        # the executor down by then.
        try:  # noqa: SIM105 - contextlib may be None by then
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass
