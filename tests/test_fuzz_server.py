"""Property-based fuzzing (issue 18): whatever a client sends, the server answers below 500,
in OpenAI's shape, and afterwards the engine is alive, nothing runs or waits and every KV
block is free.

Bodies come from two sources: the request-body schemas the server itself publishes at
/openapi.json (`from_schema` turns the JSON Schema subset pydantic writes into hypothesis
strategies), and hand-written adversarial bodies (huge and negative
numbers, lone surrogates, wrong types, odd roles and content types) around valid ones. The
default tier runs FUZZ_EXAMPLES cases per route family; the slow tier runs SLOW_EXAMPLES
(>= 2,000 requests in all) and prints the counts. SamplingParams is fuzzed through the
offline engine as well.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path

# hypothesis keeps a cache of its own: in .pytest_cache, not a new folder in the checkout
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "hypothesis"))

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_openai_server import CHAT_TEMPLATE, MAX_MODEL_LEN, make_engine

from omniinfer import LLM, SamplingParams
from omniinfer.entrypoints.openai.api_server import ServerState, build_app
from omniinfer.entrypoints.openai.limits import ServerLimits

FUZZ_EXAMPLES = 100  # per test in the default tier (~200 requests and 100 offline runs)
# per test in the slow tier (three server tests: 2,100 requests); OMNIINFER_FUZZ_EXAMPLES=N
# runs more, and OMNIINFER_FUZZ_RANDOM=1 draws new cases instead of the same ones every run
SLOW_EXAMPLES = int(os.environ.get("OMNIINFER_FUZZ_EXAMPLES", 700))
DERANDOMIZE = not os.environ.get("OMNIINFER_FUZZ_RANDOM")
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
COUNTS: Counter = Counter()  # status -> requests


def fuzz_settings(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, derandomize=DERANDOMIZE,
                    suppress_health_check=list(HealthCheck), print_blob=True)


# ---- the server, one event loop for the whole module ------------------------------------------------
class Client:
    """An httpx client on the app, on a loop of its own (hypothesis calls synchronously)."""

    def __init__(self, state: ServerState):
        self.state = state
        self.loop = asyncio.new_event_loop()
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)),
                                      base_url="http://test", timeout=60)

    def send(self, path: str, body: bytes, content_type: str | None = "application/json"):
        headers = {"content-type": content_type} if content_type else {}

        async def run():
            request = self.http.build_request("POST", path, content=body, headers=headers)
            if content_type is None:
                request.headers.pop("content-type", None)
            return await self.http.send(request)

        return self.loop.run_until_complete(asyncio.wait_for(run(), 60))

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def client(checkpoint_dir):
    state = ServerState("tiny", chat_template=CHAT_TEMPLATE, stats_interval_s=0,
                        limits=ServerLimits(max_n=4, max_body_bytes=1 << 20))
    state.attach(make_engine(checkpoint_dir("llama")))
    c = Client(state)
    yield c
    c.close()
    state.shutdown()
    if COUNTS:
        print(f"\nfuzzed {sum(COUNTS.values())} requests; by status: {dict(sorted(COUNTS.items()))}")


def check_answer(client: Client, path: str, body: bytes, content_type="application/json") -> None:
    r = client.send(path, body, content_type)
    COUNTS[r.status_code] += 1
    assert r.status_code < 500, (path, body[:300], r.text[:500])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events and events[-1] == "data: [DONE]", r.text[-300:]
        for event in events[:-1]:
            chunk = json.loads(event[len("data: "):])
            assert "error" not in chunk or chunk["error"]["type"] != "InternalServerError", chunk
    elif r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
    assert_engine_fine(client.state)


def assert_engine_fine(state: ServerState, timeout_s: float = 10) -> None:
    """Alive, nothing running or waiting, every KV block free."""
    assert state.health_error() is None, state.health_error()
    deadline = time.monotonic() + timeout_s
    while True:
        stats = state.ctx.engine.stats()
        if (stats["num_running"] == stats["num_waiting"] == stats["num_swapped"] == 0
                and stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]):
            return
        assert time.monotonic() < deadline, f"engine did not go idle: {stats}"
        time.sleep(0.01)


def dumps(body) -> bytes:
    # ensure_ascii writes lone surrogates as \\udXXX escapes, as a hostile client would
    return json.dumps(body, ensure_ascii=True, allow_nan=False).encode()


# ---- strategies: the published schema -----------------------------------------------------------------
ANY_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(
    allow_nan=False, allow_infinity=False), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=5), inner, max_size=4)),
    max_leaves=12)


def from_schema(schema: dict, defs: dict) -> st.SearchStrategy:
    """Values valid for a JSON Schema, for the subset pydantic writes ($ref, anyOf, enum,
    const, type with properties/required/items/minItems/minLength); {} is any JSON."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, defs) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, defs) for k, v in props.items() if k in required},
            optional={k: from_schema(v, defs) for k, v in props.items() if k not in required})
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs),
                        min_size=schema.get("minItems", 0), max_size=4)
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=20)
    if kind == "integer":
        return st.integers()
    if kind == "number":
        return st.floats(allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON


def schema_bodies(state: ServerState) -> st.SearchStrategy:
    client = Client(ServerState("tiny"))
    client.state.ctx = state.ctx

    async def get():
        return (await client.http.get("/openapi.json")).json()

    spec = client.loop.run_until_complete(get())
    client.close()
    components = spec["components"]["schemas"]
    strategies = []
    for path in ROUTES:
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        strategies.append(st.tuples(st.just(path), from_schema(schema, components)))
    return st.one_of(strategies)


# ---- strategies: adversarial bodies around valid ones -------------------------------------------------
HUGE_INTS = [-1, 0, 1, 2, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30,
             -(10**30)]
HUGE_FLOATS = [0.0, 1e-300, 1e-5, 0.5, 1.5, 2.0001, 3.5e38, 1e308, -1e308, -2.5]
TEXTS = st.one_of(st.text(max_size=30), st.sampled_from([
    "", "\ud800", "a\udfffb", "Return the", "\x00", "\U0001f600" * 3, "\n\n", "<|user|>"]))
INTS = st.one_of(st.integers(-3, 40), st.sampled_from(HUGE_INTS))
FLOATS = st.one_of(st.floats(-3, 3, allow_nan=False), st.sampled_from(HUGE_FLOATS))
SMALL_TOKENS = st.integers(1, 6)
WEIRD = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXTS, st.lists(INTS, max_size=4),
                  st.dictionaries(st.text(max_size=3), INTS, max_size=2))
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 383), st.sampled_from([-1, 384, 10**6, 2**63])),
                     min_size=0, max_size=12)
SAMPLING = {
    "n": st.one_of(st.integers(1, 3), INTS), "temperature": FLOATS, "top_p": FLOATS,
    "top_k": INTS, "min_p": FLOATS, "seed": INTS, "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS, "repetition_penalty": FLOATS, "min_tokens": INTS,
    "stop": st.one_of(TEXTS, st.lists(TEXTS, max_size=3)), "stop_token_ids": TOKEN_IDS,
    "ignore_eos": st.booleans(), "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({}, optional={
        "include_usage": st.booleans(), "continuous_usage_stats": st.booleans()})),
    "logit_bias": st.one_of(st.none(), st.just({"5": 1})), "user": TEXTS,
    "model": st.sampled_from([None, "tiny", "other"]),
}


def _mutated(valid: dict, fields: dict) -> st.SearchStrategy:
    """`valid`, with a few fields replaced (by their own strategy or by anything at all)."""
    names = sorted(fields)

    @st.composite
    def build(draw):
        body = dict(valid)
        for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
            body[name] = draw(st.one_of(fields[name], WEIRD) if draw(st.booleans())
                              else fields[name])
        if draw(st.integers(0, 9)) == 0:
            body.pop(draw(st.sampled_from(sorted(body))), None)
        return {k: v for k, v in body.items() if v is not None or k == "model"}

    return build()


PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                        "text": TEXTS}), max_size=2)
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot", ""]),
    "content": st.one_of(TEXTS, PARTS, st.none())})
COMPLETION_FIELDS = {**SAMPLING, "max_tokens": st.one_of(SMALL_TOKENS, INTS),
                     "prompt": st.one_of(TEXTS, TOKEN_IDS, st.lists(TEXTS, max_size=3),
                                         st.lists(TOKEN_IDS, max_size=3), WEIRD),
                     "logprobs": st.one_of(st.integers(0, 5), INTS), "echo": st.booleans(),
                     "best_of": INTS, "suffix": TEXTS}
CHAT_FIELDS = {**SAMPLING, "max_tokens": st.one_of(SMALL_TOKENS, INTS),
               "max_completion_tokens": st.one_of(SMALL_TOKENS, INTS),
               "messages": st.lists(MESSAGE, max_size=4), "logprobs": st.booleans(),
               "top_logprobs": INTS, "tools": st.one_of(st.none(), st.just([{"type": "function"}])),
               "tool_choice": st.sampled_from([None, "none", "auto", "required"]),
               "response_format": st.one_of(st.none(), st.fixed_dictionaries(
                   {"type": st.sampled_from(["text", "json_object", "xml"])})),
               "add_generation_prompt": st.booleans(), "continue_final_message": st.booleans(),
               "chat_template_kwargs": st.one_of(st.none(), st.just({"x": 1}))}
TOKENIZE_FIELDS = {"prompt": TEXTS, "messages": st.lists(MESSAGE, max_size=3),
                   "add_special_tokens": st.booleans(), "add_generation_prompt": st.booleans(),
                   "model": st.sampled_from([None, "tiny", "other"])}
DETOKENIZE_FIELDS = {"tokens": TOKEN_IDS, "model": st.sampled_from([None, "tiny", "x"])}

ADVERSARIAL = st.one_of(
    st.tuples(st.just("/v1/completions"),
              _mutated({"prompt": "Return the", "max_tokens": 4}, COMPLETION_FIELDS)),
    st.tuples(st.just("/v1/chat/completions"), _mutated(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, CHAT_FIELDS)),
    st.tuples(st.just("/tokenize"), _mutated({"prompt": "Return the"}, TOKENIZE_FIELDS)),
    st.tuples(st.just("/detokenize"), _mutated({"tokens": [5, 6]}, DETOKENIZE_FIELDS)),
)
CONTENT_TYPES = st.sampled_from(["application/json"] * 8 + ["text/plain", None,
                                                             "application/json; charset=utf-8"])


def _bounded(body) -> bool:
    """Keep generation short (the model is tiny, but 2,000 cases add up)."""
    if not isinstance(body, dict):
        return True
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 8 < value <= MAX_MODEL_LEN:
            return False
    return True


def _run_adversarial(client, data) -> None:
    path, body = data.draw(ADVERSARIAL.filter(lambda pb: _bounded(pb[1])))
    check_answer(client, path, dumps(body), data.draw(CONTENT_TYPES))


def _run_schema(client, data, strategy) -> None:
    path, body = data.draw(strategy.filter(lambda pb: _bounded(pb[1])))
    if isinstance(body, dict) and path != "/detokenize":
        body.setdefault("max_tokens", 4)  # the schema allows the model's whole length
    check_answer(client, path, dumps(body))


# ---- the tests --------------------------------------------------------------------------------------
def test_fuzz_adversarial_bodies(client):
    @fuzz_settings(FUZZ_EXAMPLES)
    @given(st.data())
    def run(data):
        _run_adversarial(client, data)

    run()


def test_fuzz_bodies_from_the_openapi_schema(client):
    strategy = schema_bodies(client.state)

    @fuzz_settings(FUZZ_EXAMPLES)
    @given(st.data())
    def run(data):
        _run_schema(client, data, strategy)

    run()


@pytest.mark.slow
def test_fuzz_long(client):
    """>= 2,000 generated requests: 0 answers >= 500, 0 engine deaths."""
    strategy = schema_bodies(client.state)
    before = sum(COUNTS.values())

    @fuzz_settings(SLOW_EXAMPLES)
    @given(st.data())
    def adversarial(data):
        _run_adversarial(client, data)

    @fuzz_settings(SLOW_EXAMPLES)
    @given(st.data())
    def from_schema_(data):
        _run_schema(client, data, strategy)

    @fuzz_settings(SLOW_EXAMPLES)
    @given(st.data())
    def mixed(data):
        if data.draw(st.booleans()):
            _run_adversarial(client, data)
        else:
            _run_schema(client, data, strategy)

    for run in (adversarial, from_schema_, mixed):
        run()
    sent = sum(COUNTS.values()) - before
    print(f"\nslow fuzz: {sent} requests, by status {dict(sorted(COUNTS.items()))}")
    assert sent >= 2000 and not any(status >= 500 for status in COUNTS)


# ---- SamplingParams through the offline engine ----------------------------------------------------------
PARAMS = st.fixed_dictionaries({}, optional={
    "n": st.one_of(st.integers(1, 3), INTS), "temperature": FLOATS, "top_p": FLOATS,
    "top_k": INTS, "min_p": FLOATS, "seed": INTS, "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS, "repetition_penalty": FLOATS, "min_tokens": st.integers(0, 3),
    "max_tokens": st.integers(1, 3), "logprobs": st.one_of(st.integers(0, 5), INTS),
    "prompt_logprobs": st.one_of(st.integers(0, 5), INTS), "stop_token_ids": TOKEN_IDS,
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2), "ignore_eos": st.booleans()})


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(checkpoint_dir("llama"), num_kv_blocks=64, block_size=8, max_num_seqs=8,
               max_model_len=64)


def test_fuzz_sampling_params_offline(llm):
    """Any SamplingParams either refuses with a ValueError/TypeError naming the argument, or
    runs, batched with an innocent request, without harming it."""
    innocent = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    expected = llm.generate({"prompt_token_ids": [5, 6, 7]}, innocent, use_tqdm=False)

    @fuzz_settings(FUZZ_EXAMPLES)
    @given(PARAMS)
    def run(kwargs):
        try:
            params = SamplingParams(**kwargs)
            outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, "Return the"],
                                [innocent, params], use_tqdm=False)
        except (ValueError, TypeError) as e:
            assert any(name in str(e) for name in kwargs) or "prompts[1]" in str(e), e
            return
        assert outs[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
        assert all(c.finish_reason in ("stop", "length") for c in outs[1].outputs)
        stats = llm.llm_engine.stats()
        assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]

    run()
