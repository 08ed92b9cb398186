"""Compile a request's StructuredOutputsParams into a grammar, with xgrammar.

Why xgrammar and not llguidance: measured on this project's CPU (docs/structured_output.md),
filling the next-token bitmask of 16 matchers over the demo model's 4,096-token vocabulary
costs 1.5 us a row with xgrammar 0.2.9 against 16 us with llguidance 1.9.1, and compiling a
schema costs about the same (0.5-0.8 ms). The mask is on every step; compiling once a request.

The engine (`LLMEngine.add_request`) compiles, so a bad schema, regex or grammar is refused
when the request is added (an HTTP 400 that says what is wrong), and the compiled grammar
travels to the driver worker with the sequence (`NewSeq.grammar`), where each sequence gets its
own matcher (`omniinfer.structured.state`). xgrammar is an optional dependency: the `structured`
extra.
"""

from __future__ import annotations

import json
import threading

from omniinfer.structured.params import StructuredOutputsParams

# whitespace characters allowed between two JSON tokens: without a bound a small model may
# write spaces until max_tokens and never close the object
MAX_WHITESPACE = 4
INSTALL_HINT = "pip install 'omniinfer[structured]' (xgrammar)"


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(f"structured outputs and tool calling with tool_choice 'required' or a "
                          f"named function need the xgrammar package: {INSTALL_HINT} ({e})") from None
    return xgrammar


class GrammarError(ValueError):
    """The schema, regex or grammar of a request does not compile (the request's fault)."""


class GrammarCompiler:
    """One per engine: the tokenizer's vocabulary as xgrammar sees it, and a compile cache."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        xgr = import_xgrammar()
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self._lock = threading.Lock()  # the server adds requests from several threads

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar (xgrammar's CompiledGrammar); GrammarError when it does not
        compile, naming what is wrong."""
        kind = spec.kind
        try:
            with self._lock:
                return self._compile(spec, kind)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"structured_outputs.{kind} does not compile: {_first_line(e)}") from None

    def _compile(self, spec: StructuredOutputsParams, kind: str):
        c = self._compiler
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else spec.json
            if schema is True or schema == {}:
                return c.compile_builtin_json_grammar()  # any JSON value
            _check_schema(schema)
            any_ws = not spec.disable_any_whitespace and spec.whitespace_pattern is None
            return c.compile_json_schema(json.dumps(schema), any_whitespace=any_ws,
                                         separators=None if any_ws else (",", ":"),
                                         strict_mode=True,
                                         max_whitespace_cnt=MAX_WHITESPACE if any_ws else None)
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(spec.choice))
        return c.compile_grammar(spec.grammar)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices`."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _check_schema(schema) -> None:
    """The schema is itself valid JSON Schema (jsonschema's meta-schema check when installed),
    so a typo such as `"type": "strng"` is a 400 rather than a grammar that means something
    else."""
    if not isinstance(schema, dict):
        raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        import jsonschema
    except ImportError:
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(f"invalid JSON schema at {where}: {e.message}") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:500]


def compile_grammar(engine, params):
    """The compiled grammar of `params.structured_outputs` (None without one), from the engine's
    compiler (made on the first constrained request, so that an engine never asked for one
    needs no xgrammar)."""
    spec = params.structured_outputs
    if spec is None:
        return None
    compiler = getattr(engine, "_grammar_compiler", None)
    if compiler is None:
        compiler = GrammarCompiler(engine.tokenizer, engine.config.model.vocab_size,
                                   engine.eos_token_ids)
        engine._grammar_compiler = compiler
    return compiler.compile(spec)
