"""The tool-call parsers on replies written the way each model family writes them (the formats
of the Hermes / Qwen 2.5 chat templates, Meta's Llama 3.1 JSON tool calling, Mistral's
`[TOOL_CALLS]`), whole and streamed a character at a time."""

from __future__ import annotations

import json

import pytest

from omniinfer.entrypoints.openai.tools.parsers import get_parser, parse_required
from omniinfer.entrypoints.openai.tools.serving import ToolPlan, ToolStream

WEATHER = {"name": "get_weather", "args": {"city": "Paris", "days": 2}}
ADD = {"name": "add", "args": {"a": 1, "b": [2, {"c": "}"}]}}

REPLIES = {
    "hermes": ("Let me check.\n<tool_call>\n" + json.dumps(
        {"name": "get_weather", "arguments": WEATHER["args"]}) + "\n</tool_call>\n<tool_call>\n"
        + json.dumps({"name": "add", "arguments": ADD["args"]}) + "\n</tool_call>",
        "Let me check."),
    "llama3_json": ("<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": WEATHER["args"]})
                    + "; " + json.dumps({"name": "add", "parameters": ADD["args"]}), None),
    "mistral": ("[TOOL_CALLS] " + json.dumps([{"name": "get_weather", "arguments": WEATHER["args"]},
                                               {"name": "add", "arguments": ADD["args"]}]), None),
}


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_each_format_parses_whole(name):
    text, content = REPLIES[name]
    got_content, calls = get_parser(name).parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (WEATHER["name"], WEATHER["args"]), (ADD["name"], ADD["args"])]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_plain_and_broken_replies_stay_content(name):
    parser = get_parser(name)
    assert parser.parse("Just text, no call.") == ("Just text, no call.", [])
    broken = REPLIES[name][0][:-7]  # cut short: the JSON does not close
    assert parser.parse(broken) == (broken, [])


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_streamed_a_character_at_a_time(name):
    text, content = REPLIES[name]
    stream = ToolStream(ToolPlan("auto", get_parser(name)))
    deltas = []
    for i, ch in enumerate(text):
        deltas += stream.feed(ch, i == len(text) - 1)
    streamed_content = "".join(d.get("content", "") for d in deltas)
    assert streamed_content.rstrip() == (content or "")  # (the newline before a call streams)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [c["index"] for c in calls] == [0, 1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (WEATHER["name"], WEATHER["args"]), (ADD["name"], ADD["args"])]


def test_streamed_text_is_not_held_back_and_partial_markers_are():
    stream = ToolStream(ToolPlan("auto", get_parser("hermes")))
    assert stream.feed("Hello <tool", False) == [{"content": "Hello "}]
    assert stream.feed("bar> there", True) == [{"content": "<toolbar> there"}]


def test_named_arguments_stream_as_written_and_required_parses_the_array():
    stream = ToolStream(ToolPlan("named", None, "add"))
    first = stream.feed('{"a": ', False)
    assert first[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}
    calls = parse_required('[{"name": "add", "parameters": {"a": 1}}, '
                           '{"name": "get_weather", "parameters": {"city": "x", "days": 1}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1}), ("get_weather", {"city": "x", "days": 1})]
    assert parse_required('[{"name": "add", "param') == []


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_parser("qwen_xml")
