"""What the engine returns for a request (names and fields as vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omniinfer.engine.sequence import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    error: str | None = None  # with finish_reason "error": what went wrong

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    # the error is the engine's (processing this request failed inside a step), not a
    # problem with the request itself (which is refused when it is added)
    is_internal_error: bool = False
    metrics: dict = field(default_factory=dict)
