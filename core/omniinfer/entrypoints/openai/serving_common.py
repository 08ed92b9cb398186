"""What completions and chat share: the served model, prompt checks, streams, logprobs, SSE."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from omniinfer.engine.outputs import RequestOutput
from omniinfer.engine.request_checks import check_text
from omniinfer.entrypoints import chat_utils
from omniinfer.entrypoints.openai.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestEndedError,
)
from omniinfer.entrypoints.openai.limits import ServerLimits
from omniinfer.entrypoints.openai.protocol import GENERATION_DEFAULTS, APIError, usage
from omniinfer.entrypoints.openai.tools.serving import ToolConfig
from omniinfer.entrypoints.serve_options import GenerationOptions
from omniinfer.logger import init_logger
from omniinfer.sampling.params import SamplingParams

logger = init_logger(__name__)

# Texts up to this many characters are tokenized on the event loop (well under a millisecond);
# longer ones on the context's tokenizing thread, so that /health and the other requests never
# wait for them.
SMALL_TEXT_CHARS = 8192
# A longer text is first tokenized in its first PREFIX_CHARS_PER_TOKEN * (limit + margin)
# characters: when those alone are over the limit, the request is refused without tokenizing
# (and holding in memory) the rest, which for a 16 MiB body would take seconds and gigabytes.
PREFIX_CHARS_PER_TOKEN = 16
PREFIX_MARGIN_TOKENS = 8  # a cut mid-word can change the count by a token or two


class ServingContext:
    """The served model as the handlers see it.

    `tokenizer` is the server's own copy (the engine thread uses the engine's), used on the
    event loop; long texts go to one tokenizing thread with a copy of its own, so no tokenizer
    is ever used by two threads at once."""

    def __init__(self, engine: AsyncLLMEngine, tokenizer, *, model_name: str,
                 chat_template: str | None = None, limits: ServerLimits | None = None,
                 log_requests: bool = False, generation_defaults: dict | None = None):
        self.engine = engine
        self.log_requests = log_requests  # one log line per request (--enable-log-requests)
        self.tokenizer = tokenizer
        self.model_name = model_name
        config = engine.engine.config.model
        self.model_path = config.model
        self.max_model_len = config.max_model_len
        self.vocab_size = config.vocab_size
        self.max_logprobs = config.max_logprobs
        self.chat_template = chat_template
        self.limits = limits or ServerLimits()
        limit = self.limits.max_prompt_tokens
        self.max_prompt_tokens = min(limit or self.max_model_len, self.max_model_len - 1)
        if generation_defaults is None:  # the checkpoint's generation_config.json ('auto')
            generation_defaults = GenerationOptions().defaults(config.generation_config, GENERATION_DEFAULTS)
        self.generation_defaults = generation_defaults
        self._bulk_tokenizer = None
        self.tools = ToolConfig()  # the server's tool flags (set by ServerState.attach)
        self.reasoning_parser = None  # --reasoning-parser (set by ServerState.attach)
        self._bulk = ThreadPoolExecutor(1, thread_name_prefix="omniinfer-tokenize")

    def close(self) -> None:
        self._bulk.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{model}` does not exist; this server serves "
                           f"`{self.model_name}`", 404, type="NotFoundError", param="model",
                           code="model_not_found")

    def check_request(self, req) -> None:
        """What every generation request is checked for before anything is tokenized."""
        req.check_unsupported()
        self.check_model(req.model)
        req.check_limits(self.limits, self.max_logprobs)

    async def off_loop(self, fn, *args):
        """Run `fn(*args)` on the tokenizing thread (for work that grows with the request)."""
        return await asyncio.get_running_loop().run_in_executor(self._bulk, fn, *args)

    async def tokenize(self, text: str, *, add_special_tokens: bool, param: str = "prompt",
                       ) -> list[int]:
        """Token ids of a text, checked against max_prompt_tokens; long texts off the loop."""
        try:
            check_text(param, text)
        except ValueError as e:
            raise APIError(str(e), param=param) from None
        if len(text) <= SMALL_TEXT_CHARS:
            ids = list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        else:
            ids = await self.off_loop(self._tokenize_long, text, add_special_tokens, param)
        self._check_prompt_tokens(len(ids), param)
        return ids

    def _tokenize_long(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if self._bulk_tokenizer is None:
            self._bulk_tokenizer = copy.deepcopy(self.tokenizer)
        tokenizer, limit = self._bulk_tokenizer, self.max_prompt_tokens
        window = PREFIX_CHARS_PER_TOKEN * (limit + PREFIX_MARGIN_TOKENS)
        if len(text) > window:
            cut = text.rfind(" ", window // 2, window)  # at a word boundary where there is one
            head = text[: cut if cut > 0 else window]
            num = len(tokenizer(head, add_special_tokens=add_special_tokens).input_ids)
            if num > limit + PREFIX_MARGIN_TOKENS:
                raise APIError(f"{param} has more than {limit} tokens (its first {len(head)} "
                               f"characters alone make {num}); this server allows at most "
                               f"{limit} prompt tokens", param=param)
        return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    async def detokenize(self, token_ids: list[int]) -> str:
        if len(token_ids) <= SMALL_TEXT_CHARS // 4:
            return self.tokenizer.decode(token_ids)
        return await self.off_loop(self._detokenize_long, token_ids)

    def _detokenize_long(self, token_ids: list[int]) -> str:
        if self._bulk_tokenizer is None:
            self._bulk_tokenizer = copy.deepcopy(self.tokenizer)
        return self._bulk_tokenizer.decode(token_ids)

    def _check_prompt_tokens(self, num: int, param: str) -> None:
        limit = self.max_prompt_tokens
        if num > limit:
            why = ("max_model_len - 1" if limit == self.max_model_len - 1
                   else "--max-prompt-tokens")
            raise APIError(f"{param} has {num} tokens; this server allows at most {limit} prompt "
                           f"tokens ({why}={limit})", param=param)

    async def prompt_input(self, prompt: str | list[int], *, add_special_tokens: bool = True,
                           param: str = "prompt") -> dict:
        """{"prompt", "prompt_token_ids"} of a text or token-id prompt, checked like the engine does."""
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(f"{param} is empty; give at least one character or token", param=param)
            ids = await self.tokenize(prompt, add_special_tokens=add_special_tokens, param=param)
            prompt_input = {"prompt": prompt, "prompt_token_ids": ids}
        else:
            self._check_prompt_tokens(len(prompt), param)
            prompt_input = {"prompt": None, "prompt_token_ids": list(prompt)}
        try:  # reads only the config: safe off the engine thread
            self.engine.engine.tokenize_prompt({"prompt_token_ids": prompt_input["prompt_token_ids"]})
        except (ValueError, TypeError) as e:
            raise APIError(str(e), param=param) from None
        return prompt_input

    @staticmethod
    def truncated(prompt_input: dict, params: SamplingParams) -> dict:
        """The prompt cut to its last `truncate_prompt_tokens` tokens (vLLM's extra); a cut
        prompt's text is dropped, so that echo and usage report the tokens that ran."""
        keep, ids = params.truncate_prompt_tokens, prompt_input["prompt_token_ids"]
        if keep is None or len(ids) <= keep:
            return prompt_input
        return {"prompt": None, "prompt_token_ids": ids[-keep:]}

    def check_length(self, prompt_input: dict, params: SamplingParams, *,
                     prompt_param: str = "prompt") -> None:
        """The engine's limits for this request (max_model_len, the KV cache, max_logprobs, n):
        a 400 naming the field to blame."""
        try:  # reads the config and the block count only: safe off the engine thread
            self.engine.engine.check_request(len(prompt_input["prompt_token_ids"]), params)
        except (ValueError, TypeError) as e:
            error = APIError.from_validation(e)
            if error.param == "prompt":
                error.param = prompt_param
            raise error from None

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool,
                    continue_final_message: bool, kwargs: dict | None) -> str:
        if not self.chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise APIError(f"the model `{self.model_name}` has no chat template in its tokenizer; "
                           "start the server with --chat-template FILE_OR_STRING", param="messages")
        try:
            return chat_utils.render(self.tokenizer, messages, chat_template=self.chat_template,
                                     add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message,
                                     chat_template_kwargs=kwargs)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None

    def generate(self, request_id: str, prompt_input: dict, params: SamplingParams,
                 ) -> AsyncIterator[RequestOutput]:
        if self.log_requests:
            ids = prompt_input["prompt_token_ids"]
            logger.info("request %s: %d prompt tokens %s, params %s", request_id, len(ids),
                        _head(ids), params)
        return self.engine.generate(request_id, prompt_input, params)


def _head(ids: list[int], num: int = 16) -> str:
    return repr(ids) if len(ids) <= num else repr(ids[:num])[:-1] + ", ...]"


def output_error(out: RequestOutput) -> APIError | None:
    """The request ended with an error: a 500 when processing it failed inside a step (the
    engine and the other requests go on), else a 400 (a request the scheduler refused)."""
    if out.error:
        if out.is_internal_error:
            return APIError(out.error, 500, type="InternalServerError", code="request_failed")
        return APIError(out.error)
    for c in out.outputs:
        if c.finish_reason == "error":
            return APIError(c.error or "the request failed")
    return None


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, (ValueError, TypeError)):
        return APIError.from_validation(e)
    if isinstance(e, EngineDeadError):
        return APIError(str(e), 500, type="InternalServerError", code="engine_dead")
    if isinstance(e, RequestEndedError):
        return APIError(str(e), 503, type="ServiceUnavailableError", code="server_shutting_down")
    return APIError(f"{type(e).__name__}: {e}", 500, type="InternalServerError")


async def merge(streams: list[AsyncIterator[RequestOutput]],
                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index, output) from several request streams as they arrive; closing it aborts them all."""
    if len(streams) == 1:
        stream = streams[0]
        try:
            async for out in stream:
                yield 0, out
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class StreamProgress:
    """What a streamed response has sent so far, per choice index, and how to frame a chunk."""

    def __init__(self, request_id: str, object_name: str, model: str, num_prompt: int,
                 include_usage: bool, created: int):
        self.header = {"id": request_id, "object": object_name, "created": created, "model": model}
        self.num_prompt = num_prompt
        self.include_usage = include_usage
        self.sent_text: dict[int, int] = {}  # characters sent
        self.sent_tokens: dict[int, int] = {}  # tokens sent
        self.finished: set[int] = set()

    def news(self, index: int, completion, wants_logprobs: bool):
        """(new text, new token ids, text sent before, tokens sent before), or None when there
        is nothing to say yet (a partial character, a held-back stop string)."""
        start_text = self.sent_text.get(index, 0)
        start_tokens = self.sent_tokens.get(index, 0)
        text, new_ids = completion.text[start_text:], completion.token_ids[start_tokens:]
        if index in self.finished or not (text or (wants_logprobs and new_ids)
                                          or completion.finish_reason):
            return None
        return text, new_ids, start_text, start_tokens

    def sent(self, index: int, completion) -> None:
        self.sent_text[index], self.sent_tokens[index] = len(completion.text), len(completion.token_ids)
        if completion.finish_reason is not None:
            self.finished.add(index)

    def chunk(self, choices: list, with_usage: bool | None) -> str:
        body = {**self.header, "choices": choices}
        if self.include_usage:
            body["usage"] = (usage(self.num_prompt, sum(self.sent_tokens.values()))
                             if with_usage else None)
        return sse(body)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def top_entries(entry: dict, num: int) -> list:
    """The `num` most likely (token id, Logprob) of one step, most likely first."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return [(tid, lp) for tid, lp in ranked if lp.rank is not None and lp.rank <= num][:num]


def token_text(tokenizer, tid: int, lp) -> str:
    return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid])


def clamped(logprob: float) -> float:
    """-inf as the JSON-safe -9999.0 OpenAI uses for "very unlikely"."""
    return max(logprob, -9999.0)


def completion_logprobs(tokenizer, token_ids: list[int], steps: list[dict | None], num: int,
                        offset: int) -> dict:
    """The legacy completions `logprobs` object for these tokens (text offsets from `offset`),
    as OpenAI and vLLM write it: a step without log-probs (the first prompt token under
    `echo`) is null; `top_logprobs` holds the chosen token and the `num` most likely (at most
    num + 1 entries, keyed by their text: tokens that print alike keep the likeliest)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(token_ids, steps):
        if entry is None:
            text = tokenizer.decode([tid])
            out["tokens"].append(text)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            text = token_text(tokenizer, tid, entry[tid])
            out["tokens"].append(text)
            out["token_logprobs"].append(clamped(entry[tid].logprob))
            top: dict[str, float] = {}
            for t, lp in list(entry.items())[: num + 1]:  # the chosen token first, then by rank
                key = token_text(tokenizer, t, lp)
                top[key] = max(top.get(key, -float("inf")), clamped(lp.logprob))
            out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def prompt_logprobs_json(tokenizer, entries: list[dict | None] | None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt token, {token id: {logprob, rank,
    decoded_token}} (null for the first token)."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": clamped(lp.logprob), "rank": lp.rank,
                      "decoded_token": token_text(tokenizer, t, lp)} for t, lp in entry.items()}
            for entry in entries]


def chat_logprobs(tokenizer, token_ids: list[int], steps: list[dict], num: int) -> dict:
    def item(tid, lp):
        text = token_text(tokenizer, tid, lp)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(item(tid, entry[tid]), top_logprobs=[item(t, lp) for t, lp in
                                                                  top_entries(entry, num)])
                        for tid, entry in zip(token_ids, steps)]}
