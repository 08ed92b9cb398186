"""SamplingParams: how one request samples and when it stops (names as vLLM's)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is not allowed; it must be a finite number")
    return float(value)


def _int(name: str, value, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


@dataclass
class SamplingParams:
    """Sampling and stopping for one request.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1 disables top-p;
    min_p 0 disables min-p. `logprobs=N` returns the N most likely tokens plus the chosen
    one at every step (raw model log-probabilities, before any penalty or temperature);
    `prompt_logprobs=N` does the same for the prompt. `max_tokens=None` generates up to
    the model's context length.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n={self.n} is not allowed; it must be >= 1")
        self.temperature = _number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} is not allowed; it must be >= 0 "
                             "(0 means greedy)")
        self.top_p = _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} is not allowed; it must be in (0, 1]")
        _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} is not allowed; it must be -1 (disabled), 0 "
                             "(disabled) or a positive int")
        self.min_p = _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} is not allowed; it must be in [0, 1]")
        _int("seed", self.seed, allow_none=True)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name}={value} is not allowed; it must be in [-2, 2]")
            setattr(self, name, value)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} is not allowed; it must "
                             "be > 0 (1 disables it)")
        _int("max_tokens", self.max_tokens, allow_none=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} is not allowed; it must be >= 1")
        _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} is not allowed; it must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is not allowed; it must be <= "
                             f"max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _int(name, value, allow_none=True)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name}={value} is not allowed; it must be in [0, {MAX_LOGPROBS}]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise TypeError(f"stop={self.stop!r} is not allowed; it must be a non-empty string or "
                            "a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids={self.stop_token_ids!r} is not allowed; it must "
                                 "be a list of non-negative ints")
        if self.temperature < 1e-5:  # greedy: sampling knobs do not apply
            self.temperature = 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax and nothing else: the sampler's fast path."""
        return (self.temperature == 0.0 and self.logprobs is None and self.min_tokens == 0
                and not self.has_penalties)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
