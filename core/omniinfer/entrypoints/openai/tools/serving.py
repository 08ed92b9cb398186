"""Tool calling in POST /v1/chat/completions: what a request's tools change in its prompt, its
sampling and its answer (whole, or streamed as OpenAI streams tool-call deltas)."""

from __future__ import annotations

from dataclasses import dataclass

from omniinfer.entrypoints.openai.tools.parsers import ToolCall, ToolParser, parse_required


@dataclass
class ToolConfig:
    """The server's `--enable-auto-tool-choice` and `--tool-call-parser`."""

    enable_auto_tool_choice: bool = False
    parser: ToolParser | None = None


@dataclass
class ToolPlan:
    """How one request uses its tools: choice is 'none', 'auto', 'required' or 'named'."""

    choice: str
    parser: ToolParser | None
    function_name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: false keeps the first call of an 'auto' reply

    @classmethod
    def of(cls, req, config: ToolConfig) -> ToolPlan:
        choice = req.resolved_tool_choice(config.enable_auto_tool_choice and config.parser is not None)
        name = req.named_function.name if choice == "named" else None
        return cls(choice, config.parser if choice == "auto" else None, name,
                   req.parallel_tool_calls)

    @property
    def calls_tools(self) -> bool:
        return self.choice != "none"

    def message(self, text: str) -> tuple[dict, bool]:
        """The assistant message of a finished reply, and whether it holds tool calls."""
        content, calls = self.split(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        return message, bool(calls)

    def split(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.choice == "named":
            return None, [ToolCall(self.function_name, text)]
        if self.choice == "required":
            calls = parse_required(text)
            return (None, calls) if calls else (text, [])
        if self.choice == "auto":
            content, calls = self.parser.parse(text)
            return content, calls if self.parallel else calls[:1]
        return text, []


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI says "tool_calls" when a reply that ended by itself holds calls."""
    return "tool_calls" if has_calls and reason == "stop" else reason


class ToolStream:
    """One choice's streamed reply: text in, OpenAI deltas out. Content streams as it comes;
    a named function's arguments stream as they are written; 'required' and 'auto' calls are
    sent once their text parses (each call whole: its id, name and arguments in one delta)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""
        self.sent_content = 0  # characters of `text` sent as content
        self.num_calls_sent = 0

    def feed(self, delta: str, finished: bool) -> list[dict]:
        self.text += delta
        plan = self.plan
        if plan.choice == "named":
            out = []
            if self.num_calls_sent == 0:
                self.num_calls_sent = 1
                out.append(self._call_delta(0, ToolCall(plan.function_name, "")))
            if delta:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta}}]})
            return out
        if plan.choice == "none":
            return [{"content": delta}] if delta else []
        if not finished:  # content that surely is no call, as it comes
            end = 0 if plan.choice == "required" else plan.parser.content_end(self.text)
            return self._content(end)
        content, calls = plan.split(self.text)
        if not calls:
            return self._content(len(self.text))
        end = 0 if plan.choice == "required" else plan.parser.content_end(self.text)
        out = self._content(len(self.text[:end].rstrip()))
        for i, call in enumerate(calls):
            out.append(self._call_delta(i, call, call.arguments))
        self.num_calls_sent = len(calls)
        return out

    def _content(self, end: int) -> list[dict]:
        if end <= self.sent_content:
            return []
        piece, self.sent_content = self.text[self.sent_content:end], end
        return [{"content": piece}]

    @staticmethod
    def _call_delta(index: int, call: ToolCall, arguments: str = "") -> dict:
        return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": arguments}}]}


def add_tool_flags(parser, env_default) -> None:
    """vLLM's two tool flags on `omniinfer serve`."""
    from omniinfer.entrypoints.openai.tools.parsers import PARSERS

    group = parser.add_argument_group("tool calling (see docs/structured_output.md)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       default=env_default("enable_auto_tool_choice", False, bool),
                       help="let the model decide when to call tools (tool_choice 'auto', the "
                       "default when tools are given); needs --tool-call-parser")
    group.add_argument("--tool-call-parser", choices=sorted(PARSERS),
                       default=env_default("tool_call_parser", None),
                       help="how the model writes tool calls: hermes (Hermes, Qwen), "
                       "llama3_json (Llama 3.x), mistral")


def tool_config(args) -> ToolConfig:
    from omniinfer.entrypoints.openai.tools.parsers import get_parser

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of hermes, "
                         "llama3_json, mistral)")
    return ToolConfig(args.enable_auto_tool_choice,
                      get_parser(args.tool_call_parser) if args.tool_call_parser else None)
