"""The offline Python API: `LLM(model, ...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

from omniinfer.config import EngineArgs
from omniinfer.engine.llm_engine import LLMEngine
from omniinfer.engine.outputs import RequestOutput
from omniinfer.sampling.params import GENERATION_DEFAULTS, SamplingParams

# Offline batches stream nothing, so several decode steps per schedule only save host time
# (small bf16 model, 64 x (128 + 128), same process: 1.07x with 4 steps, 1.09x with 8, 1.10x
# with 16). The engine's own default, for serving, stays 1.
OFFLINE_SCHEDULER_STEPS = 8


class LLM:
    """An engine for offline batched generation.

    Keyword arguments are the engine arguments (see `omniinfer.config.EngineArgs`): device,
    dtype, seed, block_size, num_kv_blocks, kv_cache_memory_bytes, swap_space,
    max_model_len, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill,
    enable_prefix_caching, preemption_mode, attention_backend, tensor_parallel_size,
    pipeline_parallel_size, distributed_executor_backend, worker_cls, speculative_model,
    num_speculative_tokens, num_scheduler_steps, max_logprobs.

    `num_scheduler_steps` (multi-step decoding) defaults to 8 here, 1 with a speculative model;
    the engine's default, for serving, is 1. Pass 1 for one schedule per token.
    """

    def __init__(self, model: str, **kwargs):
        allowed = set(EngineArgs.field_names()) - {"model"}
        unknown = sorted(set(kwargs) - allowed)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                            f"allowed: {', '.join(sorted(allowed))}")
        if kwargs.get("num_scheduler_steps") is None and kwargs.get("speculative_model") is None \
                and kwargs.get("speculative_config") is None:
            kwargs["num_scheduler_steps"] = OFFLINE_SCHEDULER_STEPS
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's workers and processes (also on `with LLM(...) as llm:` exit, when
        the object is collected, and at interpreter exit); idempotent."""
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        # No module globals here (contextlib, ...): collected during interpreter teardown, as an
        # object in a reference cycle is, they may already be None. The atexit hook has shut
        # the executor down by then.
        try:  # noqa: SIM105 - contextlib may be None by then
            self.shutdown()
        except Exception:  # noqa: BLE001
            pass

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the sampling defaults of the checkpoint's generation_config.json
        (temperature, top_p, top_k, min_p, repetition_penalty), as vLLM's; what generate() and
        chat() use when given none."""
        from omniinfer.entrypoints.serve_options import GenerationOptions

        picked = GenerationOptions().defaults(self.llm_engine.config.model.generation_config,
                                              GENERATION_DEFAULTS)
        try:
            return SamplingParams(**picked)
        except (ValueError, TypeError) as e:
            raise ValueError(f"the checkpoint's generation_config.json sets {picked}, which is not "
                             f"allowed: {e}") from None

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list; returns one RequestOutput per prompt, in order.

        A prompt is a string, {"prompt": text} or {"prompt_token_ids": [...]}. Every prompt is
        checked before any is queued, so a bad one raises without starting the others."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a string, a dict with 'prompt' or 'prompt_token_ids', "
                            f"or a list of them; got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts; "
                             "give one, or one per prompt")
        engine = self.llm_engine
        checked = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be SamplingParams, got {type(p).__name__}")
            try:
                text, ids = engine.tokenize_prompt(prompt, p)
                engine.check_request(len(ids), p)
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
            checked.append({"prompt": text, "prompt_token_ids": ids})
        request_ids = [f"llm-{next(self._ids)}" for _ in checked]
        for rid, prompt, p in zip(request_ids, checked, params):
            engine.add_request(rid, prompt, p, stream=False)
        try:
            finished = self._run(set(request_ids), len(request_ids), use_tqdm)
        except BaseException:
            engine.abort_request(request_ids)
            raise
        return [finished[rid] for rid in request_ids]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list of
        conversations; one RequestOutput each, in order, its `prompt` the rendered text.

        As vLLM's `LLM.chat`: each conversation goes through the chat template (`chat_template`,
        else the tokenizer's), with `tools` and `chat_template_kwargs` given to it, and the text
        is tokenized without adding special tokens (the template writes them). Content may be a
        string or a list of text parts. Every conversation is checked and rendered before any
        is queued."""
        from omniinfer.engine.request_checks import check_text
        from omniinfer.entrypoints import chat_utils

        tokenizer = self.get_tokenizer()
        prompts = []
        for i, conversation in enumerate(chat_utils.conversations(messages)):
            try:
                text = chat_utils.render(tokenizer, conversation, chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tools=tools,
                                         chat_template_kwargs=chat_template_kwargs)
                check_text("messages", text)
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}") from None
            ids = chat_utils.prompt_token_ids(tokenizer, text)
            if not ids:
                raise ValueError(f"messages: conversation {i} renders to no tokens with this chat "
                                 "template")
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, pending: set[str], total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        from tqdm.auto import tqdm

        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        num_in = num_out = 0
        with tqdm(total=total, desc="Processed prompts", unit="prompt", disable=not use_tqdm,
                  dynamic_ncols=True) as bar:
            while pending:
                for out in engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                        num_in += len(out.prompt_token_ids)
                        num_out += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"in: {num_in / elapsed:.0f} tok/s, "
                                            f"out: {num_out / elapsed:.0f} tok/s", refresh=False)
                        bar.update(1)
        return finished
