"""The checks a request passes before it is queued: its prompt and the limits of this engine.

SamplingParams checks what it can alone (types and ranges); what depends on the served model
and the engine's configuration is checked here, so that nothing a request carries can fail
inside a step. Every error is a ValueError/TypeError whose message starts with the name of
the field to blame (`prompt`, `max_tokens`, `n`, `logprobs`, ...), which the server maps to
an OpenAI error's `param`.
"""

from __future__ import annotations

import numbers

import numpy as np

from omniinfer.config import EngineConfig
from omniinfer.sampling.params import SamplingParams


def check_text(name: str, text: str) -> None:
    """Reject a string that cannot be encoded as UTF-8 (a lone surrogate such as '\\ud800',
    which JSON's \\u escapes can carry but no tokenizer accepts)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} holds invalid Unicode at character {e.start} ({text[e.start]!r}, "
                         "a lone surrogate); send valid UTF-8 text") from None


def token_ids(prompt: dict, vocab_size: int) -> list[int]:
    """The checked `prompt_token_ids` of a prompt dict, as a list of Python ints (numpy integers
    and 1-D integer arrays are accepted)."""
    ids = prompt["prompt_token_ids"]
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(f"prompt_token_ids must be a 1-D array of ints, got dtype {ids.dtype} "
                            f"with shape {ids.shape}")
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
    if not ids:
        raise ValueError("prompt_token_ids is empty; give at least one token")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise TypeError(f"prompt_token_ids must hold ints, got {t!r} ({type(t).__name__})")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt_token_ids holds token id {t}; allowed: 0 <= id < "
                             f"vocab size {vocab_size}")
    return [int(t) for t in ids]


def check_params(config: EngineConfig, params: SamplingParams) -> None:
    """The limits of this engine and model that SamplingParams cannot know."""
    limit = config.model.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limit:
            raise ValueError(f"{name}={value} is not allowed; it must be in [0, {limit}] "
                             f"(max_logprobs={limit})")
    max_num_seqs = config.scheduler.max_num_seqs
    if params.n > max_num_seqs:
        raise ValueError(f"n={params.n} is not allowed; it must be <= max_num_seqs={max_num_seqs} "
                         "(a request's n samples run in one batch)")
    vocab = config.model.vocab_size
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids holds token id {bad[0]}; allowed: 0 <= id < vocab size "
                         f"{vocab}")
    bad = [t for t in params.logit_bias or () if t >= vocab]
    if bad:
        raise ValueError(f"logit_bias holds token id {bad[0]}; allowed: 0 <= id < vocab size "
                         f"{vocab}")
    if params.allowed_token_ids is not None and params.allowed_token_ids[-1] >= vocab:  # (sorted)
        raise ValueError(f"allowed_token_ids holds token id {params.allowed_token_ids[-1]}; "
                         f"allowed: 0 <= id < vocab size {vocab}")


def bad_words_token_ids(tokenizer, words: list[str], vocab_size: int) -> list[list[int]]:
    """The token id sequences that spell each bad word (vLLM's rule): as written (leading
    spaces stripped) and after a space, the second only where the space joins the word's first
    token (same length, another first token) rather than making a token of its own. Sequences
    holding an id outside the model's vocabulary can never be generated and are left out."""
    out: list[list[int]] = []
    for word in words:
        bare = list(tokenizer(word.lstrip(), add_special_tokens=False).input_ids)
        spaced = list(tokenizer(" " + word.lstrip(), add_special_tokens=False).input_ids)
        for ids in (bare, spaced):
            if (ids and ids not in out and max(ids) < vocab_size
                    and (ids is bare or (len(ids) == len(bare) and ids[0] != bare[0]))):
                out.append(ids)
    return out


def resolve_max_tokens(config: EngineConfig, num_prompt_tokens: int, params: SamplingParams) -> int:
    """The request's budget of generated tokens within max_model_len."""
    limit = config.model.max_model_len
    if num_prompt_tokens >= limit:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens; max_model_len={limit} leaves no "
                         "room to generate")
    if params.max_tokens is None:
        return limit - num_prompt_tokens
    if num_prompt_tokens + params.max_tokens > limit:
        raise ValueError(f"max_tokens={params.max_tokens} is too large: the prompt has "
                         f"{num_prompt_tokens} tokens and {num_prompt_tokens + params.max_tokens} "
                         f"exceeds max_model_len={limit}")
    return params.max_tokens


def check_fits(scheduler, num_prompt_tokens: int, max_tokens: int, params: SamplingParams) -> None:
    """A request the scheduler could never run (more KV blocks than exist, a prompt over the
    step's token budget without chunked prefill) is refused here, not failed later."""
    if scheduler.never_fits(num_prompt_tokens, 1) is not None:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens: "
                         f"{scheduler.never_fits(num_prompt_tokens, 1)}")
    reason = scheduler.never_fits(num_prompt_tokens, max_tokens)
    if reason is not None:
        raise ValueError(f"max_tokens={params.max_tokens}: {reason}")
