"""SamplingParams: how one request samples and when it stops (names as vLLM's).

Every number here ends up in a tensor or a loop of the engine step, so each has a range,
checked at construction (numpy scalars are accepted and become Python numbers). What depends
on the served model (`logprobs` against `max_logprobs`, `n` against `max_num_seqs`, token ids
against the vocabulary, the length against `max_model_len`) is checked by the engine when the
request is added.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from omniinfer.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20  # the default of the engine's max_logprobs
MAX_TEMPERATURE = 100.0  # far past the point where the distribution is already flat
MAX_TOP_K = (1 << 31) - 1  # top_k above the vocabulary size keeps every token
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # any signed or unsigned 64-bit seed
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it
# the sampling defaults a checkpoint's generation_config.json may set, taken for what a request
# leaves unset (the server's requests, and LLM.generate without SamplingParams), as vLLM does
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # entries of allowed_token_ids (more than any vocabulary here)
MAX_BAD_WORDS = 1024
MAX_BAD_WORD_CHARS = 1024


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is not allowed; it must be a finite number")
    return value


def _int(name: str, value, *, allow_none: bool = False) -> int | None:
    """`value` as a Python int (numpy integers too); bools and non-integers are a TypeError."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


@dataclass
class SamplingParams:
    """Sampling and stopping for one request.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1 disables top-p;
    min_p 0 disables min-p. `logprobs=N` returns the N most likely tokens plus the chosen
    one at every step (raw model log-probabilities, before any penalty or temperature);
    `prompt_logprobs=N` does the same for the prompt. `max_tokens=None` generates up to
    the model's context length. `logit_bias` {token id: bias} is added to those logits before
    penalties and sampling, as OpenAI defines it (log-probs stay the raw model's).

    vLLM's extras: `allowed_token_ids` are the only tokens that may be sampled; `bad_words`
    are never generated (each word's tokens, as written and after a space: the last token is
    banned wherever the output so far ends with the ones before it); `truncate_prompt_tokens=k`
    keeps the prompt's last k tokens; `detokenize=False` returns token ids without text (no
    stop strings then).

    Ranges: n >= 1; temperature [0, 100]; top_p (0, 1]; top_k -1, 0 or [1, 2**31 - 1]; min_p
    [0, 1]; seed a 64-bit int; presence/frequency_penalty [-2, 2]; repetition_penalty
    [0.01, 100]; max_tokens >= 1; 0 <= min_tokens <= max_tokens; logprobs, prompt_logprobs >= 0;
    at most 64 stop strings of at most 1024 characters; at most 1024 stop_token_ids >= 0;
    logit_bias at most 1024 entries, token ids >= 0, biases in [-100, 100]; allowed_token_ids
    1 .. 2**18 ids >= 0; at most 1024 bad_words of at most 1024 characters;
    truncate_prompt_tokens >= 1.
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
    logit_bias: dict[int, float] | None = None
    # the output follows a JSON schema, regex, choice or grammar (docs/structured_output.md);
    # a dict of StructuredOutputsParams' fields is accepted; `guided_decoding` is vLLM's old name
    structured_outputs: StructuredOutputsParams | dict | None = None
    guided_decoding: StructuredOutputsParams | dict | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    # bad_words as token id sequences: filled by the engine from its tokenizer when the request
    # is added (the sampler, on the workers, has no tokenizer)
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.guided_decoding is not None and self.structured_outputs is None:
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self.n = _int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n={self.n} is not allowed; it must be >= 1")
        self.temperature = _number("temperature", self.temperature)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature={self.temperature} is not allowed; it must be in "
                             f"[0, {MAX_TEMPERATURE:g}] (0 means greedy)")
        self.top_p = _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} is not allowed; it must be in (0, 1]")
        self.top_k = _int("top_k", self.top_k)
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k={self.top_k} is not allowed; it must be -1 (disabled), 0 "
                             f"(disabled) or an int in [1, {MAX_TOP_K}]")
        self.min_p = _number("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p} is not allowed; it must be in [0, 1]")
        self.seed = _int("seed", self.seed, allow_none=True)
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed={self.seed} is not allowed; it must be a 64-bit int in "
                             f"[{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2 <= value <= 2:
                raise ValueError(f"{name}={value} is not allowed; it must be in [-2, 2]")
            setattr(self, name, value)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} is not allowed; it must "
                             f"be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] "
                             "(1 disables it)")
        self.max_tokens = _int("max_tokens", self.max_tokens, allow_none=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} is not allowed; it must be >= 1")
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} is not allowed; it must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is not allowed; it must be <= "
                             f"max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = _int(name, getattr(self, name), allow_none=True)
            if value is not None and value < 0:
                raise ValueError(f"{name}={value} is not allowed; it must be >= 0 (and at most "
                                 f"the engine's max_logprobs, {MAX_LOGPROBS} by default)")
            setattr(self, name, value)
        self._check_stops()
        self._check_logit_bias()
        self._check_vllm_extras()
        if self.temperature < 1e-5:  # greedy: sampling knobs do not apply
            self.temperature = 0.0

    def _check_stops(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise TypeError(f"stop={_short(self.stop)} is not allowed; it must be a non-empty "
                            "string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop={_short(self.stop)} is not allowed; at most {MAX_STOP_STRINGS} "
                             f"strings of at most {MAX_STOP_STRING_CHARS} characters each")
        ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if len(ids) > MAX_STOP_TOKEN_IDS or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids={_short(ids)} is not allowed; it must be a list of "
                             f"at most {MAX_STOP_TOKEN_IDS} non-negative ints")
        self.stop_token_ids = [int(t) for t in ids]

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None or (isinstance(bias, dict) and not bias):
            self.logit_bias = None
            return
        if not isinstance(bias, dict):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got "
                            f"{type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS} "
                             "are allowed")
        checked = {}
        for tid, value in bias.items():
            if isinstance(tid, bool) or not isinstance(tid, numbers.Integral) or tid < 0:
                raise ValueError(f"logit_bias holds the key {tid!r}; its keys must be token ids "
                                 "(ints >= 0)")
            value = _number("logit_bias", value)
            if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias holds the bias {value:g} for token {tid}; a bias "
                                 f"must be in [-{MAX_ABS_LOGIT_BIAS:g}, {MAX_ABS_LOGIT_BIAS:g}]")
            checked[int(tid)] = value
        self.logit_bias = checked

    def _check_vllm_extras(self) -> None:
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not 1 <= len(ids) <= MAX_ALLOWED_TOKEN_IDS or not all(
                    isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ValueError(f"allowed_token_ids={_short(ids)} is not allowed; it must be a list "
                                 f"of 1 to {MAX_ALLOWED_TOKEN_IDS} token ids (ints >= 0), or None")
            self.allowed_token_ids = sorted({int(t) for t in ids})
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or len(words) > MAX_BAD_WORDS or not all(
                    isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in words):
                raise ValueError(f"bad_words={_short(words)} is not allowed; it must be a list of at "
                                 f"most {MAX_BAD_WORDS} words (non-blank strings of at most "
                                 f"{MAX_BAD_WORD_CHARS} characters)")
            self.bad_words = list(words) or None
        self.truncate_prompt_tokens = _int("truncate_prompt_tokens", self.truncate_prompt_tokens,
                                           allow_none=True)
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens={self.truncate_prompt_tokens} is not allowed; "
                             "it must be >= 1 (keep the prompt's last k tokens), or None")
        if not isinstance(self.detokenize, bool):
            raise TypeError(f"detokenize must be a bool, got {self.detokenize!r}")
        if not self.detokenize and self.stop:
            raise ValueError(f"stop={_short(self.stop)} needs detokenize=True (stop strings are "
                             "found in the text); use stop_token_ids without text")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def is_plain_greedy(self) -> bool:
        """Argmax and nothing else: the sampler's fast path."""
        return (self.temperature == 0.0 and self.logprobs is None and self.min_tokens == 0
                and not self.has_penalties and self.logit_bias is None
                and self.allowed_token_ids is None and not self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
