"""Issue 18, in-process: no request can hurt the engine or the others. Bad input of every kind
gets a precise OpenAI error naming the right field, and the engine is alive and idle after it.
(The socket-level cases, shutdown and worker deaths are in test_serve_lifecycle.py.)"""

from __future__ import annotations

import asyncio
import json

import pytest
from test_openai_server import (
    CHAT_TEMPLATE,
    MESSAGES,
    assert_openai_error,
    call,
    make_engine,
    metric_values,
    wait_idle,
)

from omniinfer.entrypoints.openai.api_server import ServerState
from omniinfer.entrypoints.openai.limits import ServerLimits
from omniinfer.entrypoints.openai.serving_common import PREFIX_CHARS_PER_TOKEN

GOOD = {"model": "tiny", "prompt": "Return the", "max_tokens": 3}


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    state = ServerState("tiny", chat_template=CHAT_TEMPLATE, stats_interval_s=0,
                        limits=ServerLimits(max_n=4, max_body_bytes=1 << 20))
    state.attach(make_engine(checkpoint_dir("llama")))
    yield state
    state.shutdown()


def post(state, path: str, body, headers=None):
    async def run(_client, http):
        if isinstance(body, bytes):
            return await http.post(path, content=body, headers=headers or {
                "content-type": "application/json"})
        return await http.post(path, json=body, headers=headers)

    return call(state, run)


def assert_alive(state) -> None:
    """The engine serves a good request, and nothing is left running or holding blocks."""
    r = post(state, "/v1/completions", GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    wait_idle(state)


# ---- item 1: values that used to kill the engine --------------------------------------------------
@pytest.mark.parametrize("extra,param", [
    ({"top_k": 2**63, "temperature": 1, "top_p": 0.9}, "top_k"),
    ({"repetition_penalty": 1e308}, "repetition_penalty"),
    ({"temperature": 1e308}, "temperature"),
    ({"seed": 2**70}, "seed"),
    ({"frequency_penalty": 1e308}, "frequency_penalty"),
    ({"min_tokens": 2**63}, "min_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(2000))}, "stop_token_ids"),
    ({"logprobs": 2**40}, "logprobs"),
    ({"prompt": [2**63]}, "prompt"),
])
def test_huge_numbers_are_a_400_and_the_engine_lives(server, extra, param):
    assert_openai_error(post(server, "/v1/completions", {**GOOD, **extra}), 400, param)
    assert_alive(server)


def test_a_bad_request_batched_with_an_innocent_one(server):
    """Concurrently: the innocent request completes, the bad one is refused, the engine lives."""
    async def run(_client, http):
        innocent = asyncio.create_task(http.post("/v1/completions", json={
            **GOOD, "max_tokens": 20, "ignore_eos": True, "temperature": 0}))
        bad = [await http.post("/v1/completions", json={**GOOD, **extra})
               for extra in ({"top_k": 2**63}, {"repetition_penalty": 1e308})]
        return await innocent, bad

    innocent, bad = call(server, run)
    assert innocent.status_code == 200 and innocent.json()["usage"]["completion_tokens"] == 20
    assert [r.status_code for r in bad] == [400, 400]
    assert_alive(server)


# ---- item 4: invalid Unicode; item 8: lenient edges -----------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"prompt": "Return the\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udc00"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}',
     "messages"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}', "stop"),
])
def test_lone_surrogates_are_a_400_naming_the_field(server, path, body, param):
    error = assert_openai_error(post(server, path, body), 400, param)
    assert "invalid Unicode" in error["message"]
    assert_alive(server)


def test_a_surrogate_pair_is_fine(server):
    r = post(server, "/tokenize", b'{"prompt": "hi \\ud83d\\ude00"}')
    assert r.status_code == 200 and r.json()["count"] > 0


@pytest.mark.parametrize("headers", [{"content-type": "text/plain"}, {},
                                     {"content-type": "application/x-www-form-urlencoded"}])
def test_a_body_that_is_not_declared_json_is_a_415(server, headers):
    """A cross-site 'simple' POST (text/plain, a form) must not make a keyless server generate."""
    async def run(_client, http):
        request = http.build_request("POST", "/v1/completions", content=json.dumps(GOOD).encode())
        for name in list(request.headers):
            if name.lower() == "content-type":
                del request.headers[name]
        request.headers.update(headers)
        return await http.send(request)

    assert_openai_error(call(server, run), 415)
    ok = post(server, "/v1/completions", json.dumps(GOOD).encode(),
              headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"messages": MESSAGES, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}, None),
])
def test_lenient_edges_are_refused(server, path, body, param):
    if isinstance(body.get("temperature"), float):  # NaN is not JSON: httpx will not send it
        raw = json.dumps(body).encode()
        assert b"NaN" in raw
        assert "not valid JSON" in assert_openai_error(post(server, path, raw), 400)["message"]
        return
    assert_openai_error(post(server, path, body), 400, param)


def test_missing_model_uses_the_served_one_and_tool_choice_none_is_fine(server):
    r = post(server, "/v1/completions", {"prompt": "Return the", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    r = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                              "tool_choice": "none"})
    assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_trailing_slash_is_served_not_redirected(server):
    async def run(_client, http):
        return await http.get("/v1/models/", headers={"host": "evil.example"})

    r = call(server, run)
    assert r.status_code == 200 and "location" not in r.headers
    assert r.json()["data"][0]["id"] == "tiny"


def test_openapi_is_behind_the_key_and_describes_the_bodies(server):
    state = ServerState("tiny", api_key="sk-x")
    state.ctx = server.ctx

    async def run(_client, http):
        return (await http.get("/openapi.json"),
                await http.get("/openapi.json", headers={"Authorization": "Bearer sk-x"}))

    locked, schema = call(state, run)
    assert_openai_error(locked, 401)
    spec = schema.json()
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/CompletionRequest"
    assert "ChatMessage" in spec["components"]["schemas"]


# ---- item 2: bounded bodies --------------------------------------------------------------------------
def test_a_body_over_the_limit_is_a_413(server):
    big = json.dumps({**GOOD, "prompt": "x" * (1 << 20)}).encode()
    error = assert_openai_error(post(server, "/v1/completions", big), 413)
    assert "--max-body-bytes" in error["message"] and error["code"] == "request_too_large"

    async def chunked(_client, http):  # no Content-Length: counted as it arrives
        async def parts():
            for _ in range(5):
                yield b" " * (300 << 10)
            yield json.dumps(GOOD).encode()

        return await http.post("/v1/completions", content=parts(),
                               headers={"content-type": "application/json"})

    assert_openai_error(call(server, chunked), 413)
    assert_alive(server)


def test_a_long_prompt_is_refused_without_tokenizing_all_of_it(server, monkeypatch):
    ctx = server.ctx
    limit = ctx.max_prompt_tokens
    seen = []
    real = ctx.tokenizer.__class__.__call__

    def spy(self, text, *args, **kwargs):
        seen.append(len(text))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(ctx.tokenizer.__class__, "__call__", spy)
    text = "Return the number of items. " * 30000  # 840k characters
    error = assert_openai_error(post(server, "/v1/completions", {**GOOD, "prompt": text}), 400,
                                "prompt")
    assert f"more than {limit} tokens" in error["message"]
    assert max(seen) <= PREFIX_CHARS_PER_TOKEN * (limit + 16)
    # a prompt that fits is tokenized whole, off the event loop, and served
    fits = "Return the number of items. " * 3
    assert post(server, "/v1/completions", {**GOOD, "prompt": fits}).status_code == 200
    assert_alive(server)


# ---- item 5: n; item 7: the right field -----------------------------------------------------------
@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/completions", {"prompt": "hi", "n": 30000, "max_tokens": 1}, "n", "--max-n"),
    ("/v1/completions", {"prompt": "hi", "n": 5}, "n", "at most 4"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 30000}, "n", "--max-n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 100},
     "top_logprobs", "[0, 20]"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1},
     "top_logprobs", "[0, 20]"),
    ("/v1/completions", {"prompt": "hi " * 200, "max_tokens": 4}, "prompt", "at most 127"),
    ("/v1/completions", {"prompt": list(range(5, 200)), "max_tokens": 4}, "prompt", "at most 127"),
    ("/v1/completions", {"prompt": list(range(5, 120)), "max_tokens": 20}, "max_tokens",
     "max_model_len=128"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 200}]},
     "messages", "at most 127"),
])
def test_limits_name_the_right_field(server, path, body, param, words):
    error = assert_openai_error(post(server, path, {"model": "tiny", **body}), 400, param)
    assert words in error["message"]


def test_a_request_bigger_than_the_kv_cache_names_the_field(checkpoint_dir):
    state = ServerState("tiny", chat_template=CHAT_TEMPLATE, stats_interval_s=0)
    state.attach(make_engine(checkpoint_dir("llama"), num_kv_blocks=4))  # 32 tokens
    try:
        error = assert_openai_error(post(state, "/v1/completions", {
            "prompt": [5, 6, 7], "max_tokens": 40}), 400, "max_tokens")
        assert "KV-cache blocks" in error["message"] and "only 4 blocks" in error["message"]
        error = assert_openai_error(post(state, "/v1/completions", {
            "prompt": list(range(5, 45)), "max_tokens": 1}), 400, "prompt")
        assert "KV-cache blocks" in error["message"]
        error = assert_openai_error(post(state, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi " * 20}], "max_tokens": 1}), 400,
            "messages")
        assert post(state, "/v1/completions", {"prompt": [5, 6], "max_tokens": 4}).status_code == 200
    finally:
        state.shutdown()


# ---- the last line: an unhandled error is an OpenAI 500 -------------------------------------------------
def test_an_unhandled_error_is_an_openai_500(server, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("a bug in a handler")

    monkeypatch.setattr(server.ctx, "render_chat", broken)
    error = assert_openai_error(post(server, "/v1/chat/completions", {"messages": MESSAGES}), 500)
    assert "KeyError" in error["message"] and error["type"] == "InternalServerError"
    monkeypatch.undo()
    assert_alive(server)


def test_metrics_show_the_engine_alive(server):
    async def run(_client, http):
        return await http.get("/metrics")

    assert metric_values(call(server, run).text)[("omniinfer:engine_dead", ())] == 0
