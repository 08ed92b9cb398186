"""The OpenAI-compatible server in-process: the official `openai` client over httpx's ASGI
transport against a tiny checkpoint. (tests/test_serve_socket.py runs it over a real socket.)"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from omniinfer.config import EngineArgs
from omniinfer.engine.llm_engine import LLMEngine
from omniinfer.entrypoints.openai import async_engine
from omniinfer.entrypoints.openai.api_server import ServerState, build_app
from omniinfer.entrypoints.openai.metrics import ServerMetrics
from omniinfer.executor.base import WorkerFailedError
from omniinfer.sampling.params import SamplingParams

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Return the number of items"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MAX_MODEL_LEN = 128


def make_engine(path: str, **kwargs) -> LLMEngine:
    args = dict(num_kv_blocks=64, block_size=8, max_num_seqs=8, max_num_batched_tokens=64,
                max_model_len=MAX_MODEL_LEN)
    return LLMEngine.from_engine_args(EngineArgs(model=path, **{**args, **kwargs}), progress=False)


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    state = ServerState("tiny", chat_template=CHAT_TEMPLATE, stats_interval_s=0)
    state.attach(make_engine(checkpoint_dir("llama")))
    yield state
    state.shutdown()


def call(state: ServerState, fn, timeout_s: float = 60):
    """Run `await fn(client, http)` on a fresh event loop against `state`'s app."""

    async def main():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            client = openai.AsyncOpenAI(api_key="unused", base_url="http://test/v1",
                                        http_client=http, max_retries=0)
            return await asyncio.wait_for(fn(client, http), timeout_s)

    return asyncio.run(main())


def wait_idle(state: ServerState, timeout_s: float = 10) -> dict:
    """The engine's stats once nothing runs and every block is free (fails on a leak)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = state.ctx.engine.stats()
        if (stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]
                and stats["num_running"] == stats["num_waiting"] == 0):
            return stats
        assert time.monotonic() < deadline, f"engine did not go idle: {stats}"
        time.sleep(0.05)


def metric_values(text: str) -> dict[tuple, float]:
    """{(sample name, sorted label items without model_name): value} of a /metrics page."""
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            values[(s.name, labels)] = s.value
    return values


# ---- completions -------------------------------------------------------------------------------
def test_greedy_completion_matches_transformers(server, checkpoint_dir, hf_greedy):
    tok = server.ctx.tokenizer
    prompt = "The quick brown fox"
    ids = tok(prompt).input_ids
    expected = tok.decode(hf_greedy(checkpoint_dir("llama"), ids, 12), skip_special_tokens=True)

    async def run(client, _http):
        by_text = await client.completions.create(model="tiny", prompt=prompt, max_tokens=12, **GREEDY)
        by_ids = await client.completions.create(model="tiny", prompt=ids, max_tokens=12, **GREEDY)
        return by_text, by_ids

    by_text, by_ids = call(server, run)
    for r in (by_text, by_ids):
        (choice,) = r.choices
        assert choice.text == expected and choice.finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
            len(ids), 12, len(ids) + 12)
        assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    wait_idle(server)


def test_batch_n_seed_echo_and_stop(server):
    async def run(client, _http):
        sampled = [await client.completions.create(
            model="tiny", prompt=["The quick", "Return the"], n=2, max_tokens=6, temperature=1.0,
            seed=7, extra_body={"ignore_eos": True}) for _ in range(2)]
        full = await client.completions.create(model="tiny", prompt="The quick", max_tokens=24,
                                               echo=True, **GREEDY)
        return sampled, full

    sampled, full = call(server, run)
    first, again = sampled
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert first.usage.completion_tokens == 24
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded
    assert full.choices[0].text.startswith("The quick")
    generated = full.choices[0].text[len("The quick"):]
    stop = generated[5:8]
    assert stop.strip(), "need a non-blank stop string from the greedy text"

    async def cut(client, _http):
        return await client.completions.create(model="tiny", prompt="The quick", max_tokens=24,
                                               stop=[stop], **GREEDY)

    (choice,) = call(server, cut).choices
    assert choice.text == generated[:generated.find(stop)]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop


def test_completion_logprobs(server):
    async def run(client, _http):
        return await client.completions.create(model="tiny", prompt="Return the", max_tokens=5,
                                               logprobs=3, **GREEDY)

    (choice,) = call(server, run).choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == choice.text and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3  # byte tokens may share one printed form
        assert max(top.values()) == pytest.approx(chosen)  # greedy picks the most likely


def test_vllm_sampling_extras_pass_through(server, monkeypatch):
    """allowed_token_ids, bad_words and truncate_prompt_tokens (vLLM's extra_body fields; what
    each does is tested offline in tests/test_sampling_extras.py)."""
    tok = server.ctx.tokenizer
    ids = tok("Return the number of items").input_ids
    seen = []
    generate = server.ctx.generate
    monkeypatch.setattr(server.ctx, "generate", lambda rid, prompt, params: seen.append(params) or
                        generate(rid, prompt, params))

    async def run(client, _http):
        only = await client.completions.create(
            model="tiny", prompt=ids, max_tokens=4, temperature=0,
            extra_body={"allowed_token_ids": [40], "bad_words": ["xyz"], "ignore_eos": True})
        cut = await client.completions.create(
            model="tiny", prompt=ids, max_tokens=2, temperature=0, echo=True,
            extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True})
        chat = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=2, temperature=0,
            extra_body={"truncate_prompt_tokens": 5})
        return only, cut, chat

    only, cut, chat = call(server, run)
    assert only.choices[0].text == tok.decode([40] * 4)
    assert seen[0].allowed_token_ids == [40] and seen[0].bad_words == ["xyz"]
    # (" xyz" is a space token and then the same three: covered by the first)
    assert seen[0].bad_words_token_ids == [tok("xyz", add_special_tokens=False).input_ids]
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text.startswith(tok.decode(ids[-3:]))
    assert chat.usage.prompt_tokens == 5
    wait_idle(server)


@pytest.mark.parametrize("extra, match", [
    ({"allowed_token_ids": [3, 10**9]}, "allowed_token_ids holds token id 1000000000; allowed: 0 <= id < vocab"),
    ({"allowed_token_ids": []}, r"allowed_token_ids=\[\] is not allowed"),
    ({"allowed_token_ids": list(range(300000))}, "allowed_token_ids holds 300000 items; at most 262144"),
    ({"bad_words": [""]}, "bad_words=.* is not allowed"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens=0 is not allowed"),
])
def test_bad_vllm_sampling_extras_are_400s_naming_the_field(server, extra, match):
    async def run(client, _http):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=extra)
        return refused.value.body

    error = call(server, run)
    assert error["param"] == next(iter(extra)) and re.search(match, error["message"]), error


# ---- chat --------------------------------------------------------------------------------------
def test_chat_uses_the_template_and_matches_completions(server):
    async def run(client, http):
        chat = await client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                    max_completion_tokens=8, **GREEDY)
        tokens = (await http.post("/tokenize", json={"messages": MESSAGES})).json()
        plain = await client.completions.create(model="tiny", prompt=tokens["tokens"],
                                                max_tokens=8, **GREEDY)
        return chat, tokens, plain

    chat, tokens, plain = call(server, run)
    expected = server.ctx.tokenizer.apply_chat_template(
        MESSAGES, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert tokens["tokens"] == server.ctx.tokenizer(expected, add_special_tokens=False).input_ids
    (choice,) = chat.choices
    assert choice.message.role == "assistant" and choice.message.content == plain.choices[0].text
    assert choice.finish_reason == "length" and chat.object == "chat.completion"
    assert chat.usage.prompt_tokens == tokens["count"] and chat.usage.completion_tokens == 8


def test_chat_text_parts_are_joined_by_newlines_as_vllm_and_llm_chat_do(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Return the"},
                                          {"type": "text", "text": "number"}]}]
    image = [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                          {"type": "image_url", "image_url": {"url": "data:,"}}]}]

    async def run(client, http):
        tokens = (await http.post("/tokenize", json={"messages": parts})).json()
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="tiny", messages=image, max_tokens=2)
        return tokens, refused.value

    tokens, refused = call(server, run)
    joined = [{"role": "user", "content": "Return the\nnumber"}]
    expected = server.ctx.tokenizer.apply_chat_template(
        joined, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert tokens["tokens"] == server.ctx.tokenizer(expected, add_special_tokens=False).input_ids
    error = refused.body
    assert error["param"] == "messages"
    assert "content[1] is a content part of type 'image_url'; only" in error["message"]


def test_chat_logprobs(server):
    async def run(client, _http):
        return await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                                    logprobs=True, top_logprobs=2, **GREEDY)

    (choice,) = call(server, run).choices
    content = choice.logprobs.content
    assert len(content) == 4 and "".join(c.token for c in content) == choice.message.content
    for c in content:
        assert 1 <= len(c.top_logprobs) <= 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert bytes(c.bytes).decode("utf-8") == c.token


def test_chat_template_comes_from_the_tokenizer(server, checkpoint_dir, tmp_path):
    async def chat(client, _http):
        return await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)

    bare = ServerState("tiny")  # the tiny tokenizer has no template and no override is given
    bare.ctx = server.ctx.__class__(server.ctx.engine, server.ctx.tokenizer, model_name="tiny")
    with pytest.raises(openai.BadRequestError, match="--chat-template"):
        call(bare, chat)

    path = shutil.copytree(checkpoint_dir("llama"), tmp_path / "with_template")
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = CHAT_TEMPLATE.replace("<|assistant|>", "<|bot|>")
    with open(config_path, "w") as f:
        json.dump(config, f)
    state = ServerState("tiny")
    state.attach(make_engine(str(path)))
    try:
        r = call(state, chat)
        text = state.ctx.render_chat(MESSAGES, add_generation_prompt=True,
                                     continue_final_message=False, kwargs=None)
    finally:
        state.shutdown()
    assert text.endswith("<|bot|>") and r.choices[0].finish_reason in ("length", "stop")


# ---- streaming ---------------------------------------------------------------------------------
def test_streamed_completion_equals_the_whole_one(server):
    async def run(client, http):
        whole = await client.completions.create(model="tiny", prompt="The quick", max_tokens=10,
                                                **GREEDY)
        stream = await client.completions.create(model="tiny", prompt="The quick", max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True},
                                                 **GREEDY)
        chunks = [c async for c in stream]
        raw = await http.post("/v1/completions", json={
            "model": "tiny", "prompt": "The quick", "max_tokens": 3, "stream": True})
        return whole, chunks, raw

    whole, chunks, raw = call(server, run)
    *text_chunks, last = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.usage is None for c in text_chunks)
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert raw.status_code == 200 and raw.headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][len("data: "):])["object"] == "text_completion"


def test_a_multi_step_engine_serves_the_same_text(server, checkpoint_dir):
    """`omniinfer serve --num-scheduler-steps 4`: the text, streamed or whole, is the
    single-step server's."""
    engine = make_engine(checkpoint_dir("llama"), num_scheduler_steps=4)
    schedule, runs = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda: runs.append(schedule()) or runs[-1]
    multi = ServerState("tiny", chat_template=CHAT_TEMPLATE, stats_interval_s=0)
    multi.attach(engine)

    async def run(client, _http):
        whole = await client.completions.create(model="tiny", prompt="The quick", max_tokens=12,
                                                **GREEDY)
        stream = await client.completions.create(model="tiny", prompt="The quick", max_tokens=12,
                                                 stream=True, **GREEDY)
        return whole, [c async for c in stream]

    try:
        (whole, chunks), (reference, _) = call(multi, run), call(server, run)
        assert whole.choices[0].text == reference.choices[0].text
        assert "".join(c.choices[0].text for c in chunks) == reference.choices[0].text
        assert max(out.num_steps for out in runs) == 4
        wait_idle(multi)
    finally:
        multi.shutdown()


def test_streamed_chat_sends_the_role_then_the_content(server):
    async def run(client, _http):
        whole = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                                     **GREEDY)
        stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                                      stream=True, **GREEDY)
        return whole, [c async for c in stream]

    whole, chunks = call(server, run)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


# ---- errors ------------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": "many"}, "n"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),  # prompt + max_tokens too long
    ({"prompt": [1, 10**6]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({}, "prompt"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"100000": 1}}, "logit_bias"),  # past the vocabulary
    ({"prompt": "hi", "logit_bias": {"five": 1}}, "logit_bias"),
    ({"prompt": "hi", "logit_bias": {"5": "much"}}, "logit_bias"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "suffix": "!"}, "suffix"),
]
BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "max_completion_tokens": 0}, "max_tokens"),
]


def _bad_requests():
    return ([("/v1/completions", body, param) for body, param in BAD_COMPLETIONS]
            + [("/v1/chat/completions", body, param) for body, param in BAD_CHATS])


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(("path", "body", "param"), _bad_requests())
def test_bad_requests_get_an_openai_400(server, path, body, param):
    async def run(_client, http):
        return await http.post(path, json={"model": "tiny", **body})

    error = assert_openai_error(call(server, run), 400, param)
    assert error["type"] == "invalid_request_error"


def test_malformed_json_unknown_model_and_route(server):
    async def run(client, http):
        malformed = await http.post("/v1/completions", content=b"{not json",
                                    headers={"content-type": "application/json"})
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.completions.create(model="gpt-17", prompt="hi")
        return malformed, unknown.value, await http.get("/v1/nothing")

    malformed, unknown, route = call(server, run)
    assert "not valid JSON" in assert_openai_error(malformed, 400)["message"]
    assert unknown.status_code == 404 and unknown.body["param"] == "model"
    assert_openai_error(route, 404)


def test_bad_requests_do_not_disturb_a_running_one(server):
    async def run(client, http):
        solo = await client.completions.create(model="tiny", prompt="Return the", max_tokens=40,
                                               **GREEDY)
        running = asyncio.create_task(client.completions.create(
            model="tiny", prompt="Return the", max_tokens=40, **GREEDY))
        bad = [await http.post(path, json={"model": "tiny", **body})
               for path, body, _ in _bad_requests()]
        return solo, await running, bad

    solo, running, bad = call(server, run)
    assert all(r.status_code == 400 for r in bad)
    assert running.choices[0].text == solo.choices[0].text
    assert running.usage.completion_tokens == 40
    wait_idle(server)


# ---- the engine loop ---------------------------------------------------------------------------
def test_requests_join_the_running_batch_and_aborts_free_blocks(server):
    engine = server.ctx.engine

    async def run():
        long = engine.generate("long", {"prompt": None, "prompt_token_ids": [5, 6, 7]},
                               SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
        first = await long.__anext__()
        short = [out async for out in engine.generate(
            "short", {"prompt": None, "prompt_token_ids": [8, 9]},
            SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))]
        later = await long.__anext__()
        await long.aclose()  # the consumer leaves: the request is aborted
        return first, short, later

    first, short, later = asyncio.run(run())
    assert not first.finished and short[-1].finished and len(short[-1].outputs[0].token_ids) == 3
    assert not later.finished  # the short request finished while the long one still ran
    assert later.metrics["first_scheduled_time"] < short[-1].metrics["finished_time"]
    wait_idle(server)


def test_cancelled_http_request_aborts_and_frees_blocks(server):
    async def run(_client, http):
        before = metric_values((await http.get("/metrics")).text)
        task = asyncio.create_task(http.post("/v1/completions", json={
            "model": "tiny", "prompt": "hi", "max_tokens": 100, "ignore_eos": True}))
        while server.ctx.engine.stats()["num_running"] == 0:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return before

    before = call(server, run)
    wait_idle(server)

    async def after(_client, http):
        return metric_values((await http.get("/metrics")).text)

    key = ("omniinfer:request_failure_total", (("finished_reason", "abort"),))
    assert call(server, after)[key] == before[key] + 1


def test_engine_failure_is_reported_not_hung(checkpoint_dir):
    state = ServerState("tiny")
    state.attach(make_engine(checkpoint_dir("llama")))

    def boom():
        raise RuntimeError("boom: the device fell off the bus")

    state.ctx.engine.engine.step = boom

    async def run(_client, http):
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        in_flight = await http.post("/v1/completions", json=body)
        later = await http.post("/v1/completions", json={**body, "stream": True})
        return in_flight, later, await http.get("/health"), await http.get("/metrics")

    try:
        in_flight, later, health, metrics = call(state, run, timeout_s=20)
    finally:
        state.shutdown()
    for response in (in_flight, later):
        error = assert_openai_error(response, 500)
        assert "boom: the device fell off the bus" in error["message"]
    assert health.status_code == 503 and "boom" in health.json()["error"]
    values = metric_values(metrics.text)  # not stale: nothing runs any more
    assert values[("omniinfer:engine_dead", ())] == 1
    assert values[("omniinfer:num_requests_running", ())] == 0



def test_a_worker_failure_ends_requests_even_if_the_step_never_returns(checkpoint_dir, monkeypatch):
    """A worker dies while the driver waits in a collective that does not notice: the executor
    reports the failure, and the requests end with it (not at the process group's timeout)."""
    monkeypatch.setattr(async_engine, "STUCK_STEP_GRACE_S", 0.3)
    state = ServerState("tiny")
    state.attach(make_engine(checkpoint_dir("llama")))
    engine = state.ctx.engine.engine
    inside, release = threading.Event(), threading.Event()

    def stuck():
        inside.set()
        release.wait(30)
        raise RuntimeError("the collective gave up at last")

    def died():
        raise WorkerFailedError(1, "died: killed by signal 9 (SIGKILL)", 4242)

    engine.step = stuck

    async def run(_client, http):
        in_flight = asyncio.create_task(http.post("/v1/completions", json={
            "model": "tiny", "prompt": "hi", "max_tokens": 4}))
        while not inside.is_set():
            await asyncio.sleep(0.01)
        engine.executor.check_health = died
        engine.executor.on_failure()  # (the executor's watcher thread, in life)
        started = time.monotonic()
        response = await in_flight
        waited = time.monotonic() - started
        later = await http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        return response, waited, later, await http.get("/health"), await http.get("/metrics")

    try:
        response, waited, later, health, metrics = call(state, run, timeout_s=20)
        assert not release.is_set() and inside.is_set()  # the step was still stuck throughout
    finally:
        release.set()
        state.shutdown()
    for r in (response, later):
        assert "worker rank 1 (pid 4242) died" in assert_openai_error(r, 500)["message"]
    assert waited < 5
    assert health.status_code == 503
    values = metric_values(metrics.text)
    assert values[("omniinfer:engine_dead", ())] == 1
    assert values[("omniinfer:num_requests_running", ())] == 0

# ---- health, models, tokenize, auth, metrics ----------------------------------------------------
def test_health_and_routes_while_loading():
    state = ServerState("tiny")

    async def run(_client, http):
        return {path: await http.get(path) for path in ("/health", "/v1/models", "/version",
                                                        "/metrics")}

    loading = call(state, run)
    assert loading["/health"].status_code == 503 and loading["/health"].json()["status"] == "loading"
    assert_openai_error(loading["/v1/models"], 503)
    assert loading["/version"].status_code == 200 and loading["/metrics"].status_code == 200
    state.load_error = "ValueError: no such checkpoint"
    failed = call(state, run)
    assert failed["/health"].status_code == 500 and "no such" in failed["/health"].json()["error"]


def test_models_version_tokenize_detokenize(server):
    async def run(client, http):
        models = await client.models.list()
        tokens = (await http.post("/tokenize", json={"prompt": "The quick brown fox"})).json()
        text = (await http.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
        bad = await http.post("/detokenize", json={"tokens": [10**6]})
        neither = await http.post("/tokenize", json={})
        return models, tokens, text, bad, neither, (await http.get("/version")).json()

    models, tokens, text, bad, neither, version = call(server, run)
    (model,) = models.data
    assert model.id == "tiny" and model.owned_by == "omniinfer"
    assert model.model_extra["max_model_len"] == MAX_MODEL_LEN
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == MAX_MODEL_LEN
    assert text["prompt"] == "The quick brown fox"
    assert_openai_error(bad, 400, "tokens")
    assert_openai_error(neither, 400, "prompt")
    from omniinfer import __version__

    assert version == {"version": __version__}


def test_api_key(server):
    state = ServerState("tiny", api_key="sk-secret")
    state.ctx = server.ctx

    async def run(_client, http):
        out = {}
        for name, headers in [("none", {}), ("wrong", {"Authorization": "Bearer nope"}),
                              ("right", {"Authorization": "Bearer sk-secret"})]:
            out[name] = [await http.get("/v1/models", headers=headers),
                         await http.post("/tokenize", json={"prompt": "a"}, headers=headers),
                         await http.get("/health", headers=headers)]
        wrong = openai.AsyncOpenAI(api_key="nope", base_url="http://test/v1", http_client=http)
        with pytest.raises(openai.AuthenticationError):
            await wrong.completions.create(model="tiny", prompt="hi", max_tokens=1)
        right = openai.AsyncOpenAI(api_key="sk-secret", base_url="http://test/v1", http_client=http)
        out["client"] = await right.completions.create(model="tiny", prompt="hi", max_tokens=1)
        return out

    out = call(state, run)
    for name in ("none", "wrong"):
        models, tokenize, health = out[name]
        assert assert_openai_error(models, 401)["code"] == "invalid_api_key"
        assert_openai_error(tokenize, 401)
        assert health.status_code == 200
    assert all(r.status_code == 200 for r in out["right"])
    assert out["client"].usage.completion_tokens == 1


def test_metrics_in_prometheus_format(server):
    async def run(client, http):
        await client.completions.create(model="tiny", prompt="The quick", max_tokens=4, **GREEDY)
        return await http.get("/metrics")

    response = call(server, run)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    values = metric_values(response.text)
    names = {name for name, _ in values}
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"omniinfer:{gauge}" in names
    for counter in ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                    "prefix_cache_hits_total", "num_preemptions_total"):
        assert f"omniinfer:{counter}" in names
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds"):
        assert values[(f"omniinfer:{hist}_count", ())] >= 1
    assert values[("omniinfer:generation_tokens_total", ())] >= 4
    assert values[("omniinfer:request_success_total", (("finished_reason", "length"),))] >= 1
    assert 'model_name="tiny"' in response.text


def test_spec_decode_counters_and_the_stats_line(monkeypatch):
    stats = {"num_running_requests": 2, "num_waiting_requests": 1, "num_swapped_requests": 0,
             "num_running": 4, "num_waiting": 1, "num_swapped": 0, "kv_cache_usage": 0.25,
             "num_prompt_tokens": 100, "num_generation_tokens": 50, "num_spec_proposed_tokens": 40,
             "num_spec_accepted_tokens": 30, "num_spec_emitted_tokens": 36,
             "spec_acceptance_rate": 0.75, "num_spec_draft_steps": 10}
    metrics = ServerMetrics("m", stats_fn=lambda: stats)
    values = metric_values(metrics.render().decode())
    assert values[("omniinfer:spec_decode_num_draft_tokens_total", ())] == 40
    assert values[("omniinfer:spec_decode_num_accepted_tokens_total", ())] == 30
    assert values[("omniinfer:spec_decode_num_emitted_tokens_total", ())] == 36
    assert values[("omniinfer:spec_decode_draft_steps_total", ())] == 10
    assert values[("omniinfer:spec_decode_acceptance_rate", ())] == 0.75
    assert values[("omniinfer:kv_cache_usage_perc", ())] == 0.25
    lines = []
    monkeypatch.setattr("omniinfer.entrypoints.openai.metrics.logger.info", lines.append)
    metrics.log_stats(stats, 10.0)
    metrics.log_stats(stats | {"num_running_requests": 0, "num_waiting_requests": 0}, 10.0)  # idle
    (line,) = lines
    assert "prompt throughput: 10.0 tokens/s" in line and "generation throughput: 5.0" in line
    assert "running: 2, waiting: 1, swapped: 0 requests" in line and "KV cache usage: 25.0%" in line
    assert "draft acceptance rate: 75.0%" in line
