"""The operator's limits on what one request may ask of the server (`omniinfer serve` flags).

The engine's own limits (max_model_len, max_num_seqs, max_logprobs, the KV cache) apply too;
these are the server's, on top: they bound the work and memory one request can claim before
it reaches the engine, so that no request can starve the others.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20
MAX_PROMPTS = 2048  # prompts in one completions request (OpenAI's limit)
MAX_MESSAGES = 4096  # messages in one chat request
MAX_CONTENT_PARTS = 8192  # content parts in all of a chat request's messages
MAX_DETOKENIZE_TOKENS = 1 << 20  # token ids in one /detokenize request


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_n: int = 128  # choices per prompt (OpenAI's limit); also at most max_num_seqs
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    max_body_bytes: int = 16 * MiB  # a larger request body is answered 413 without parsing
    shutdown_timeout_s: float = 30.0  # SIGTERM: how long running requests may still finish

    def __post_init__(self) -> None:
        for name in ("max_n", "max_prompt_tokens", "max_body_bytes"):
            value = getattr(self, name)
            if value is None and name == "max_prompt_tokens":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an int >= 1")
        if (isinstance(self.shutdown_timeout_s, bool) or not isinstance(self.shutdown_timeout_s, (int, float))
                or not 0 <= self.shutdown_timeout_s < float("inf")):
            raise ValueError(f"shutdown_timeout_s={self.shutdown_timeout_s!r} is not allowed; it "
                             "must be a finite number of seconds >= 0")
