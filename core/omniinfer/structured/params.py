"""StructuredOutputsParams: the one constraint a request's output must follow (vLLM's names).

Exactly one of `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (a list of
strings; the output is one of them), `grammar` (an EBNF / GBNF grammar; Lark syntax is
accepted by llguidance only) or `json_object` (any JSON object). `whitespace_pattern` is
xgrammar's / vLLM's knob for JSON (`disable_any_whitespace` keeps the output compact).
Only the shape is checked here; whether the schema, regex or grammar compiles is the grammar
engine's answer, checked when the request is added (`omniinfer.structured.engine`).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass

MAX_CHOICES = 1024
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar of at most 1 MiB of text

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    structural_tag: str | None = None  # accepted for vLLM's shape; refused (not supported)

    def __post_init__(self) -> None:
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported; use json, "
                             "regex, choice, grammar or json_object")
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_KINDS)}; "
                             f"got {given or 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise TypeError("structured_outputs.json must be a JSON schema (an object), got "
                            f"{type(self.json).__name__}")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured_outputs.{name} must be a non-empty string, got "
                                f"{value!r:.80}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or len(self.choice) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"structured_outputs.choice={self.choice!r:.80} is not allowed; it "
                                 f"must be a list of 1 to {MAX_CHOICES} non-empty strings")
            self.choice = list(self.choice)
        if len(self.key) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs is {len(self.key)} characters long; at most "
                             f"{MAX_SPEC_CHARS} are allowed")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """What identifies the compiled grammar (the cache key)."""
        value = getattr(self, self.kind)
        text = value if isinstance(value, str) else _json.dumps(value, sort_keys=True)
        return f"{self.kind}|{self.whitespace_pattern}|{self.disable_any_whitespace}|{text}"

    @classmethod
    def coerce(cls, value) -> StructuredOutputsParams | None:
        """A StructuredOutputsParams from itself or a dict of its fields (the HTTP shape)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(f"structured_outputs has unknown fields {sorted(unknown)}; allowed: "
                                 f"{', '.join(cls.__dataclass_fields__)}")
            return cls(**value)
        raise TypeError("structured_outputs must be a StructuredOutputsParams or a dict, got "
                        f"{type(value).__name__}")


# vLLM's name before v0.10
GuidedDecodingParams = StructuredOutputsParams
