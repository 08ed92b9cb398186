"""OpenAI request bodies (pydantic) and their mapping to `SamplingParams`.

Field names and defaults follow OpenAI's API; the extras vLLM users pass through
`extra_body` (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...)
are accepted too. Unknown fields are ignored, so newer clients keep working.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omniinfer.entrypoints.chat_utils import content_text
from omniinfer.entrypoints.openai.limits import (
    MAX_CONTENT_PARTS,
    MAX_DETOKENIZE_TOKENS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    ServerLimits,
)
from omniinfer.entrypoints.openai.structured import StructuredFields
from omniinfer.entrypoints.openai.tools.protocol import ToolFields
from omniinfer.sampling.params import (
    GENERATION_DEFAULTS,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}` JSON."""

    def __init__(self, message: str, status_code: int = 400, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status_code, self.type, self.param, self.code = (
            message, status_code, type, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def from_validation(cls, e: Exception) -> APIError:
        """A ValueError/TypeError from the engine; `param` is the argument it names first."""
        text = str(e)
        match = re.match(r"^(?:prompts\[\d+\]: )?([a-z_]+)(?:=| must| is| has| holds|:)", text)
        return cls(text, param=match.group(1) if match else None)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # list fields whose length is checked before their items are validated: pydantic checks
    # max_length only afterwards, and validating millions of items holds the GIL for long
    max_lengths: ClassVar[dict[str, int]] = {}

    @model_validator(mode="before")
    @classmethod
    def _check_lengths(cls, data):
        if isinstance(data, dict):
            for name, limit in cls.max_lengths.items():
                value = data.get(name)
                if isinstance(value, (list, dict)) and len(value) > limit:
                    raise APIError(f"{name} holds {len(value)} items; at most {limit} are allowed",
                                   param=name)
        return data


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk, not only the last


class SamplingRequest(StructuredFields, OpenAIModel):
    """Fields shared by completions and chat completions."""

    max_lengths: ClassVar[dict[str, int]] = {"stop": MAX_STOP_STRINGS,
                                             "stop_token_ids": MAX_STOP_TOKEN_IDS,
                                             "allowed_token_ids": MAX_ALLOWED_TOKEN_IDS,
                                             "bad_words": MAX_BAD_WORDS}

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string in JSON) -> bias
    prompt_logprobs: int | None = None  # vLLM's extra: log-probs of the prompt's tokens
    allowed_token_ids: list[int] | None = None  # vLLM's extras (SamplingParams says what each does)
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def check_unsupported(self) -> None:
        if self.prompt_logprobs is not None and self.stream:
            raise APIError("prompt_logprobs is not available with stream=true (as in vLLM)",
                           param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed when stream is true",
                           param="stream_options")

    def check_limits(self, limits: ServerLimits, max_logprobs: int) -> None:
        """The operator's limits (`omniinfer serve --max-n ...`)."""
        if isinstance(self.n, int) and self.n > limits.max_n:
            raise APIError(f"n={self.n} is not allowed; this server allows at most {limits.max_n} "
                           "choices per prompt (--max-n)", param="n")

    def sampling_params(self, *, max_tokens: int | None, logprobs: int | None,
                        defaults: dict, prompt_logprobs: int | None = None) -> SamplingParams:
        picked = {}
        for name in GENERATION_DEFAULTS:
            value = getattr(self, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                picked[name] = value
        try:
            spec, self._structured_param = self.structured_spec()
            return SamplingParams(
                structured_outputs=spec, n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
                logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                logit_bias=_logit_bias(self.logit_bias), allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words, truncate_prompt_tokens=self.truncate_prompt_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, **picked)
        except (ValueError, TypeError) as e:
            raise APIError.from_validation(e) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} with its keys as ints (the values are checked by SamplingParams)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise APIError(f"logit_bias holds the key {_short(key)}; its keys must be token ids "
                           "(integers)", param="logit_bias") from None
    return out


class CompletionRequest(SamplingRequest):
    prompt: Any  # str | list[str] | list[int] | list[list[int]], checked by prompts()
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(f"best_of={self.best_of} is not supported; leave it unset or equal to "
                           f"n={self.n}", param="best_of")

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its log-probs) alone, nothing generated."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, **kwargs) -> SamplingParams:
        # echo + logprobs: the prompt's tokens are scored too (vLLM: prompt_logprobs = logprobs)
        if self.prompt_logprobs is None and self.echo and self.logprobs is not None:
            kwargs["prompt_logprobs"] = self.logprobs
        return super().sampling_params(**kwargs)

    def prompts(self, max_prompt_tokens: int) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids. Lengths are checked before
        items, so that a list of millions is refused without being walked."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p:
            if _is_token_id(p[0]):
                _check_num_tokens(p, max_prompt_tokens, "prompt")
                if all(map(_is_token_id, p)):
                    return [list(p)]
            elif len(p) > MAX_PROMPTS:
                raise APIError(f"prompt holds {len(p)} prompts; at most {MAX_PROMPTS} are allowed "
                               "in one request", param="prompt")
            else:
                for i, t in enumerate(p):
                    if isinstance(t, list):
                        _check_num_tokens(t, max_prompt_tokens, f"prompt[{i}]")
                if all(isinstance(t, str) or (isinstance(t, list) and t and all(map(_is_token_id, t)))
                       for t in p):
                    return list(p)
        raise APIError(f"prompt={_short(p)} is not allowed; give a string, a list of strings, a "
                       "list of token ids or a list of lists of token ids (none empty)",
                       param="prompt")


def _check_num_tokens(ids: list, limit: int, where: str) -> None:
    if len(ids) > limit:
        raise APIError(f"{where} has {len(ids)} tokens; this server allows at most {limit} "
                       "prompt tokens", param="prompt")


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant's earlier chain of thought (vLLM's name, DeepSeek's): templates that show it
    # again (Qwen3's) read `reasoning_content`
    reasoning: str | None = None
    reasoning_content: str | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = [part.model_dump() for part in content]
        try:
            content = content_text(content, "content")
        except (ValueError, TypeError) as e:
            raise APIError(f"messages: {e}", param="messages") from None
        message = {"role": self.role, "content": content}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [dict(c, function=dict(c.get("function") or {}))
                                     for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning
        return message


class ChatCompletionRequest(ToolFields, SamplingRequest):
    max_lengths: ClassVar[dict[str, int]] = {**SamplingRequest.max_lengths,
                                             "messages": MAX_MESSAGES}

    @model_validator(mode="before")
    @classmethod
    def _check_parts(cls, data):
        messages = data.get("messages") if isinstance(data, dict) else None
        if isinstance(messages, list):
            num = sum(len(m["content"]) for m in messages
                      if isinstance(m, dict) and isinstance(m.get("content"), list))
            if num > MAX_CONTENT_PARTS:
                raise APIError(f"messages hold {num} content parts; at most {MAX_CONTENT_PARTS} "
                               "are allowed", param="messages")
        return data

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    functions: Any = None  # the deprecated spelling of tools
    function_call: Any = None  # ... and of tool_choice

    def check_unsupported(self) -> None:
        super().check_unsupported()
        self.check_tools()
        if self.functions:
            raise APIError("functions are not supported (the deprecated spelling); use tools",
                           param="functions")
        if self.function_call is not None and self.function_call != "none":
            raise APIError(f"function_call={_short(self.function_call)} is not supported; leave it "
                           "unset or 'none'", param="function_call")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                           param="continue_final_message")

    def check_limits(self, limits: ServerLimits, max_logprobs: int) -> None:
        super().check_limits(limits, max_logprobs)
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= max_logprobs:
            raise APIError(f"top_logprobs={self.top_logprobs} is not allowed; it must be in "
                           f"[0, {max_logprobs}] (max_logprobs)", param="top_logprobs")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(OpenAIModel):
    max_lengths: ClassVar[dict[str, int]] = {"messages": MAX_MESSAGES}

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    max_lengths: ClassVar[dict[str, int]] = {"tokens": MAX_DETOKENIZE_TOKENS}

    model: str | None = None
    tokens: list[int]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
