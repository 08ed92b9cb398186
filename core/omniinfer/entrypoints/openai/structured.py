"""The request fields that ask for a structured output, and their one StructuredOutputsParams.

OpenAI's `response_format` (`json_object`; `json_schema` with `{name, schema, strict}`), vLLM's
`structured_outputs` (`{json | regex | choice | grammar | json_object, whitespace_pattern,
disable_any_whitespace}`) and vLLM's older extras `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar` (with `guided_whitespace_pattern`). At most one constraint
per request; `guided_decoding_backend` is accepted and ignored (vLLM removed it too: the
backend is xgrammar). See docs/structured_output.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from omniinfer.structured.params import StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: Any = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(BaseModel):
    """Mixed into the completion and chat request bodies."""

    response_format: ResponseFormat | None = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # ignored
    _structured_param: str | None = PrivateAttr(None)  # the field the constraint came from

    def structured_spec(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's constraint and the field it came from. ValueError/TypeError (naming
        the field) when the fields are malformed or more than one constraint is given."""
        asked: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ValueError("response_format: type 'json_schema' needs "
                                 "json_schema.schema (the JSON schema the output follows)")
            asked.append(("response_format", {"json": rf.json_schema.json_schema}))
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, dict):
                raise TypeError("structured_outputs must be an object such as {\"json\": {...}}, "
                                f"got {type(self.structured_outputs).__name__}")
            asked.append(("structured_outputs", dict(self.structured_outputs)))
        for name, kind in _GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                fields = {kind: value}
                if self.guided_whitespace_pattern:
                    fields["whitespace_pattern"] = self.guided_whitespace_pattern
                asked.append((name, fields))
        if not asked:
            return None, None
        if len(asked) > 1:
            names = ", ".join(name for name, _ in asked)
            raise ValueError(f"{asked[1][0]}: only one structured output per request is allowed; "
                             f"got {names}")
        name, fields = asked[0]
        try:
            return StructuredOutputsParams.coerce(fields), name
        except (ValueError, TypeError) as e:
            raise type(e)(f"{name}: {e}") from None



def constrain(ctx, req, params, tool_spec: StructuredOutputsParams | None = None,
              tool_choice: str | None = None) -> None:
    """Settle the request's structured output: its own (response_format, structured_outputs,
    guided_*) or, for tool_choice 'required' or a named function, the calls' schema; compiled
    now, off the engine thread (the engine then finds it in the compiler's cache), so that a
    bad schema is a 400 naming its field before anything is queued."""
    from omniinfer.entrypoints.openai.protocol import APIError
    from omniinfer.structured.engine import compile_grammar

    param = req._structured_param
    if tool_spec is not None:
        if params.structured_outputs is not None:
            raise APIError(f"{param} cannot be combined with tool_choice={tool_choice!r}, which "
                           "constrains the output to the tool call", param=param)
        params.structured_outputs, param = tool_spec, "tools"
    if params.structured_outputs is None:
        return
    try:
        compile_grammar(ctx.engine.engine, params)
    except (ValueError, ImportError) as e:
        raise APIError(f"{param}: {e}", param=param) from None
