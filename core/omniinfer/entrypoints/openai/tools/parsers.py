"""Tool-call parsers: the model's text -> (content, tool calls), named as vLLM's
`--tool-call-parser` values.

* `hermes` (Hermes, Qwen 2.5 / 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, after optional text.
* `llama3_json` (Llama 3.1-3.3): the reply is one JSON object `{"name": ..., "parameters":
  {...}}` (or several separated by `;`), optionally after `<|python_tag|>`.
* `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`.

Each parser also answers, for a text still being generated, how much of it is surely plain
content (`content_end`): streaming sends that as content and holds the rest until it parses.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


class ToolParser:
    name = ""
    start = ""  # the marker that opens the calls

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content (None when empty) and the calls of a finished reply. Text that looks
        like a call but does not parse stays content."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How many leading characters of a reply still being written are plain content: up
        to the start marker, or to a partial marker at the end."""
        i = text.find(self.start)
        if i >= 0:
            return i
        for k in range(min(len(self.start) - 1, len(text)), 0, -1):
            if self.start.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text):
        i = text.find(self.start)
        if i < 0:
            return text or None, []
        calls = []
        for body in self._CALL.findall(text[i:]):
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text or None, []
            calls.append(call)
        return text[:i].strip() or None, calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start = "{"

    def parse(self, text):
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return text or None, []
        calls, decoder, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text or None, []
            call = _call(obj, "parameters")
            if call is None:
                return text or None, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return None, calls

    def content_end(self, text):
        stripped = text.lstrip()
        if stripped.startswith("{") or "<|python_tag|>".startswith(stripped[:14]):
            return 0
        return len(text)


class MistralToolParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"

    def parse(self, text):
        i = text.find(self.start)
        if i < 0:
            return text or None, []
        body = text[i + len(self.start):].strip()
        try:
            objs, _ = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return text or None, []
        objs = objs if isinstance(objs, list) else [objs]
        calls = [_call(o, "arguments") for o in objs]
        if not calls or any(c is None for c in calls):
            return text or None, []
        return text[:i].strip() or None, calls


PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser={name!r} is not known; choose one of "
                         f"{', '.join(sorted(PARSERS))}")
    return PARSERS[name]()


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a reply constrained to `[{"name": ..., "parameters": {...}}, ...]`
    (tool_choice 'required'); [] when the reply was cut short."""
    try:
        objs = json.loads(text)
    except ValueError:
        return []
    calls = [_call(o, "parameters") for o in objs] if isinstance(objs, list) else []
    return [c for c in calls if c is not None]
