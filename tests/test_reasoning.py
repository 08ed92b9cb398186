"""`--reasoning-parser`: a thinking model's <think> text apart from its answer, whole and
streamed, with tool calls after it, and earlier reasoning given back to the template. The tiny
model is made to write a thinking reply by a structured-output choice."""

from __future__ import annotations

import random

import pytest
from test_openai_server import call, make_engine, wait_idle

from omniinfer.entrypoints.openai.api_server import ServerState
from omniinfer.entrypoints.openai.reasoning import PARSERS, ReasoningStream
from omniinfer.entrypoints.openai.tools.parsers import get_parser
from omniinfer.entrypoints.openai.tools.serving import ToolConfig

CASES = [  # text, deepseek_r1's (reasoning, content), qwen3's
    ("<think>\nI think.\n</think>\n\nThe answer.", ("I think.", "The answer."), ("I think.", "The answer.")),
    ("I think.\n</think>\n\nAnswer", ("I think.", "Answer"), (None, "I think.\n</think>\n\nAnswer")),
    ("  def f():\n    pass", ("def f():\n    pass", None), (None, "  def f():\n    pass")),
    ("<think>cut short <", ("cut short <", None), ("cut short <", None)),
    ("<think></think>Hi", (None, "Hi"), (None, "Hi")),
    ("\n<think>a</think>b</think>c", ("a", "b</think>c"), ("a", "b</think>c")),
    ("<thi", ("<thi", None), (None, "<thi")),
]


@pytest.mark.parametrize("text, r1, qwen3", CASES)
def test_split(text, r1, qwen3):
    assert PARSERS["deepseek_r1"].split(text) == r1
    assert PARSERS["qwen3"].split(text) == qwen3


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_a_stream_gives_the_whole_replys_parts_whatever_its_chunks(name):
    parser, rng = PARSERS[name], random.Random(0)
    pieces = ["<think>", "</think>", "<", "</", "think", ">", "\n", " ", "a", "b c", "\n\n"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12)))
        stream, reasoning, content, at = ReasoningStream(parser), "", "", 0
        while at < len(text):
            step = rng.randrange(1, 5)
            r, c = stream.feed(text[at:at + step], False)
            reasoning, content, at = reasoning + r, content + c, at + step
        r, c = stream.feed("", True)
        assert ((reasoning + r) or None, (content + c) or None) == parser.split(text), text


TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% if m.reasoning_content %}[{{ m.reasoning_content }}]"
            "{% endif %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
THINKING = "<think>\nstep one, then two\n</think>\n\nThe answer."
MESSAGES = [{"role": "user", "content": "Why?"}]


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    state = ServerState("tiny", chat_template=TEMPLATE, stats_interval_s=0,
                        tools=ToolConfig(True, get_parser("hermes")), reasoning_parser=PARSERS["deepseek_r1"])
    state.attach(make_engine(checkpoint_dir("llama"), max_model_len=256, num_kv_blocks=128))
    yield state
    state.shutdown()


def forced(text: str) -> dict:
    return {"temperature": 0, "max_tokens": 200, "extra_body": {"structured_outputs": {"choice": [text]}}}


def test_reasoning_apart_whole_and_streamed(server):
    async def run(client, _http):
        whole = await client.chat.completions.create(model="tiny", messages=MESSAGES, **forced(THINKING))
        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=MESSAGES, stream=True, **forced(THINKING))]
        return whole, chunks

    whole, chunks = call(server, run)
    message = whole.choices[0].message
    assert message.content == "The answer." and whole.choices[0].finish_reason == "stop"
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == "step one, then two"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "The answer."
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == "step one, then two"
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "step one, then two"
    assert not any("<think" in (d.content or "") or "think>" in (d.model_extra.get("reasoning") or "")
                   for d in deltas)
    wait_idle(server)


def test_tool_calls_after_thinking(server):
    reply = '<think>I need the time.</think>\n<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]

    async def run(client, _http):
        whole = await client.chat.completions.create(model="tiny", messages=MESSAGES, tools=tools,
                                                     **forced(reply))
        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=MESSAGES, tools=tools, stream=True, **forced(reply))]
        return whole, chunks

    whole, chunks = call(server, run)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_extra["reasoning"] == "I need the time."
    [tool_call] = choice.message.tool_calls
    assert (tool_call.function.name, tool_call.function.arguments) == ("get_time", '{"tz": "UTC"}')
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == "I need the time."
    assert [t.function.name for d in deltas for t in d.tool_calls or []] == ["get_time"]
    assert not "".join(d.content or "" for d in deltas).strip()


def test_earlier_reasoning_reaches_the_template(server):
    history = [*MESSAGES, {"role": "assistant", "content": "Because.", "reasoning_content": "I pondered."},
               {"role": "user", "content": "Sure?"}]

    async def run(_client, http):
        return (await http.post("/tokenize", json={"messages": history})).json()

    tokens = call(server, run)
    text = server.ctx.tokenizer.decode(tokens["tokens"])
    assert "<|assistant|>[I pondered.]Because.\n" in text


def test_a_reply_that_does_not_think_is_content_with_qwen3(checkpoint_dir):
    state = ServerState("tiny", chat_template=TEMPLATE, stats_interval_s=0, reasoning_parser=PARSERS["qwen3"])
    state.attach(make_engine(checkpoint_dir("llama"), max_model_len=256, num_kv_blocks=128))
    try:
        async def run(client, _http):
            return await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                        **forced("  indented answer"))

        message = call(state, run).choices[0].message
        assert message.content == "  indented answer" and "reasoning" not in (message.model_extra or {})
    finally:
        state.shutdown()


def test_the_flag_names_its_parsers():
    from omniinfer.entrypoints.cli import build_parser
    from omniinfer.entrypoints.openai.protocol import GENERATION_DEFAULTS
    from omniinfer.entrypoints.serve_options import serve_options

    args = build_parser().parse_args(["serve", "m", "--reasoning-parser", "qwen3"])
    assert serve_options(args, GENERATION_DEFAULTS).reasoning_parser is PARSERS["qwen3"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--reasoning-parser", "granite"])


def test_without_the_parser_the_think_text_stays_content(checkpoint_dir):
    """Without --reasoning-parser the think text stays in the content, as it was."""
    state = ServerState("tiny", chat_template=TEMPLATE, stats_interval_s=0)
    state.attach(make_engine(checkpoint_dir("llama"), max_model_len=256, num_kv_blocks=128))
    try:
        async def run(client, _http):
            return await client.chat.completions.create(model="tiny", messages=MESSAGES, **forced(THINKING))

        message = call(state, run).choices[0].message
        assert message.content == THINKING and "reasoning" not in (message.model_extra or {})
    finally:
        state.shutdown()
