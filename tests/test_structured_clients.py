"""`omniinfer serve` (a subprocess, the demo model, a Hermes-style tools template, vLLM's tool
flags) driven by unmodified clients: the openai SDK (`.parse()` with pydantic models, tool
calls whole and streamed), LangChain's `with_structured_output` / `bind_tools`, and LiteLLM.
Every output is checked with jsonschema or pydantic against its schema."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from test_serve_socket import free_port  # noqa: E402

from omniinfer.entrypoints.cli_generate import DEMO_MODEL  # noqa: E402
from omniinfer.testing.schemas import random_schema  # noqa: E402

TEMPLATE = Path(__file__).parent / "fixtures" / "hermes_tools.jinja"
CONSOLE_SCRIPT = Path(sys.executable).with_name("omniinfer")
MODEL = "demo"
USER = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the forecast for a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "unit": {"enum": ["C", "F"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "required": ["a", "b"],
                                  "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# what a Hermes model writes for a call (forced here: the demo model knows no tools)
HERMES_CALL = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", '
               r'"days": [1-7]\}\}</tool_call>')


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)
    kind: Literal["cat", "dog"]
    tags: list[str] = Field(max_length=2)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log = tmp_path_factory.mktemp("clients") / "server.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIINFER_")}
    env.update(OMNIINFER_CPU_THREADS="1")
    command = [str(CONSOLE_SCRIPT), "serve", DEMO_MODEL, "--port", str(port), "--served-model-name",
               MODEL, "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--num-kv-blocks", "256",
               "--uvicorn-log-level", "warning"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    yield f"{base}/v1"
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(api_key="unused", base_url=url, max_retries=0)


def _check_call(call) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_sdk_parse_with_pydantic_models(client):
    for seed in range(4):
        r = client.chat.completions.parse(model=MODEL, messages=USER, response_format=Person,
                                          max_tokens=200, seed=seed, temperature=1.0)
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
    r = client.beta.chat.completions.parse(model=MODEL, messages=USER, response_format=Person,
                                           max_tokens=200, seed=9)
    assert isinstance(r.choices[0].message.parsed, Person)


def test_random_schemas_over_http_and_vllm_extras(client):
    import random

    rng = random.Random(7)
    for i in range(8):
        schema = random_schema(rng)
        r = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=400, seed=i, response_format={
                "type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # any JSON object: unbounded, so a random model may run out of tokens; those that end parse
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=300, seed=1, n=4,
                                       response_format={"type": "json_object"})
    ended = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended)
    for extra, ok in [({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                      ({"guided_regex": "[0-9]{3}"}, lambda t: len(t) == 3 and t.isdigit()),
                      ({"guided_json": Person.model_json_schema()}, Person.model_validate_json),
                      ({"guided_grammar": 'root ::= "a" | "bb"'}, lambda t: t in ("a", "bb")),
                      ({"structured_outputs": {"choice": ["x", "y"]}}, lambda t: t in ("x", "y"))]:
        r = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=200, seed=3,
                                      extra_body=extra)
        assert ok(r.choices[0].text), (extra, r.choices[0].text)


@pytest.mark.parametrize("body, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "intger"}}}}}},
     "response_format", "properties/a/type"),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "regex does not compile"),
    ({"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}}, "guided_choice", "only one"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
])
def test_bad_constraints_are_a_400_that_says_why(client, body, param, says):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, **body)
    error = info.value.body
    assert error["param"] == param and says in error["message"], error


def test_tool_calls_whole_and_streamed(client):
    cases = [("required", None), ({"type": "function", "function": {"name": "add"}}, None),
             ("auto", {"structured_outputs": {"regex": HERMES_CALL}})]
    for choice, extra in cases:
        body = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=300,
                    seed=5, temperature=1.0, extra_body=extra)
        r = client.chat.completions.create(**body)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls" and message.tool_calls, (choice, message)
        calls = [(c.function.name, _check_call(c)) for c in message.tool_calls]
        if isinstance(choice, dict):
            assert [name for name, _ in calls] == ["add"]
        with client.chat.completions.stream(**body) as stream:  # the SDK accumulates deltas
            for _ in stream:
                pass
            final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls
        assert [(c.function.name, _check_call(c)) for c in streamed] == calls, choice
        assert final.choices[0].finish_reason == "tool_calls"
        chunks = list(client.chat.completions.create(**body, stream=True))
        first = next(c.choices[0].delta.tool_calls[0] for c in chunks
                     if c.choices and c.choices[0].delta.tool_calls)
        assert first.id.startswith("call_") and first.type == "function" and first.index == 0


def test_auto_without_a_call_is_plain_text_and_none_never_calls(client):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                           tool_choice=choice, max_tokens=20, seed=2)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_tool_history_goes_through_the_template(client):
    from transformers import AutoTokenizer

    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=1)
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    expected = tokenizer.apply_chat_template(
        [dict(m, tool_calls=[{"type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}])
         if m.get("tool_calls") else m for m in history],
        tools=TOOLS, chat_template=TEMPLATE.read_text(), tokenize=False, add_generation_prompt=True)
    assert "sunny, 21 C" in expected and '"name": "get_weather"' in expected
    assert r.usage.prompt_tokens == len(tokenizer(expected, add_special_tokens=False).input_ids)


def test_langchain_structured_output_and_bind_tools(url):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    # (max_tokens: room for a forced call whose arguments the demo model draws long; at 200 one
    # was cut short, and a cut call is no call)
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=url, api_key="unused", max_tokens=400,
                                      temperature=1.0, seed=4, max_retries=0)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Describe a pet")
        assert isinstance(person, Person), method
    # json_mode sends no schema (response_format json_object): any JSON object comes back
    assert isinstance(llm.with_structured_output(method="json_mode").invoke("JSON please"), dict)

    @tool
    def get_weather(city: str, days: int) -> str:
        """the forecast for a city"""
        return "sunny"

    for choice in ("get_weather", "any"):
        reply = llm.bind_tools([get_weather], tool_choice=choice).invoke(USER[0]["content"])
        (call,) = reply.tool_calls[:1]
        assert call["name"] == "get_weather"
        get_weather.args_schema.model_validate(call["args"])


def test_litellm_structured_output_and_tools(url):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (no fetch from the internet)
    litellm = pytest.importorskip("litellm")
    common = dict(model=f"openai/{MODEL}", api_base=url, api_key="unused", messages=USER,
                  max_tokens=400, seed=6)  # (room for long arguments, as above)
    r = litellm.completion(**common, response_format=Person)
    Person.model_validate_json(r.choices[0].message.content)
    r = litellm.completion(**common, tools=TOOLS, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    for call in r.choices[0].message.tool_calls:
        _check_call(call)
