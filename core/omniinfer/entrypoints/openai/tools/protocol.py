"""The chat request's tool fields: `tools`, `tool_choice`, `parallel_tool_calls` (OpenAI's).

`tool_choice`: "none" (the model answers in text; the tools are still shown to it through the
chat template, as vLLM does), "auto" (the model decides; its text is read by the server's
`--tool-call-parser`, which `--enable-auto-tool-choice` turns on), "required" (at least one
call) or `{"type": "function", "function": {"name": ...}}` (that function). The last two go
through structured output, so every call parses and validates against the tool's parameters.
Unset, it is "auto" when the server enables it and "none" otherwise.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omniinfer.structured.params import StructuredOutputsParams

MAX_TOOLS = 128


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "function"
    function: FunctionDef


class ToolFields(BaseModel):
    """Mixed into ChatCompletionRequest."""

    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool = True

    def check_tools(self) -> None:
        for i, tool in enumerate(self.tools or []):
            if tool.type != "function":
                raise _error(f"tools[{i}].type={tool.type!r} is not supported; only 'function' "
                               "tools are", param="tools")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise _error(f"tool_choice={str(choice)[:80]} is only allowed when tools are given",
                         param="tool_choice")
        if choice is None or choice in ("none", "auto", "required"):
            return
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(name, str) or choice.get("type", "function") != "function":
            raise _error(f"tool_choice={str(choice)[:80]} is not allowed; give 'none', 'auto', "
                           "'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           param="tool_choice")
        if name not in self.tool_names:
            raise _error(f"tool_choice names the function {name!r}, which is not in tools "
                           f"({', '.join(self.tool_names) or 'none given'})", param="tool_choice")

    @property
    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    def resolved_tool_choice(self, auto_enabled: bool) -> str:
        """'none', 'auto', 'required' or 'named'."""
        choice = self.tool_choice
        if not self.tools:
            return "none"
        if choice is None:
            return "auto" if auto_enabled else "none"
        if isinstance(choice, dict):
            return "named"
        if choice == "auto" and not auto_enabled:
            raise _error("tool_choice='auto' needs the server started with "
                           "--enable-auto-tool-choice and --tool-call-parser", param="tool_choice")
        return choice

    @property
    def named_function(self) -> FunctionDef | None:
        if not isinstance(self.tool_choice, dict):
            return None
        name = self.tool_choice["function"]["name"]
        return next(t.function for t in self.tools if t.function.name == name)

    def tool_constraint(self, choice: str) -> StructuredOutputsParams | None:
        """The structured output that makes 'required' and named choices always valid calls:
        the named function's arguments, or a JSON array of {name, parameters} (one item when
        parallel_tool_calls is false), as vLLM does."""
        if choice == "named":
            return StructuredOutputsParams(json=_parameters(self.named_function))
        if choice != "required":
            return None
        items = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "parameters": _parameters(t.function)},
                  "required": ["name", "parameters"]} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates read them (OpenAI's shape)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]


def _parameters(function: FunctionDef) -> dict:
    return function.parameters or {"type": "object", "properties": {}}


def _error(message: str, *, param: str):
    from omniinfer.entrypoints.openai.protocol import APIError  # (protocol imports this module)

    return APIError(message, param=param)
