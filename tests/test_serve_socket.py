"""`omniinfer serve` as users run it: a subprocess on a loopback port, flags and OMNIINFER_*
variables, the official client over a real socket, client disconnects, `bench serve`."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from test_openai_server import CHAT_TEMPLATE, MESSAGES, metric_values

CONSOLE_SCRIPT = Path(sys.executable).with_name("omniinfer")
KEY = "sk-socket-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(checkpoint_dir, tmp_path_factory):
    """(base url, log path) of a running `omniinfer serve`; stopped with SIGINT at the end."""
    root = tmp_path_factory.mktemp("serve")
    template = root / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    log = root / "server.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIINFER_")}
    env.update(OMNIINFER_CPU_THREADS="1", OMNIINFER_SERVED_MODEL_NAME="tiny",
               OMNIINFER_API_KEY=KEY, OMNIINFER_BLOCK_SIZE="8")
    command = [str(CONSOLE_SCRIPT), "serve", checkpoint_dir("llama"), "--port", str(port),
               "--chat-template", str(template), "--num-kv-blocks", "64", "--max-num-seqs", "8",
               "--max-model-len", "512", "--stats-interval", "1", "--uvicorn-log-level", "warning"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"server never became healthy:\n{log.read_text()}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    yield url, log
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_completions_and_streamed_chat_over_a_socket(served):
    url, _ = served
    client = openai.OpenAI(api_key=KEY, base_url=f"{url}/v1", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(model="tiny", prompt="The quick", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 6


def test_api_key_over_a_socket(served):
    url, _ = served
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(api_key="wrong", base_url=f"{url}/v1", max_retries=0).models.list()


def _stream_lines(client: httpx.Client, body: dict):
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: "):])


def test_a_request_joins_while_another_generates(served):
    url, _ = served
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        long = _stream_lines(client, {"prompt": "hello", "max_tokens": 400, "ignore_eos": True})
        next(long)
        short = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4,
                                                     "ignore_eos": True}).json()
        assert short["usage"]["completion_tokens"] == 4
        # the short one did not wait for the long one, which still generates
        running = metric_values(client.get("/metrics").text)[("omniinfer:num_requests_running", ())]
        assert running == 1
        long.close()


def _abort_count(client: httpx.Client) -> float:
    values = metric_values(client.get("/metrics").text)
    return values[("omniinfer:request_failure_total", (("finished_reason", "abort"),))]


def _wait_idle_with_aborts(client: httpx.Client, num_aborts: float) -> None:
    """Wait until nothing runs, the KV cache is empty and `num_aborts` aborts were counted."""
    deadline = time.monotonic() + 10
    while True:
        values = metric_values(client.get("/metrics").text)
        if (values[("omniinfer:num_requests_running", ())] == 0
                and values[("omniinfer:kv_cache_usage_perc", ())] == 0
                and _abort_count(client) == num_aborts):
            return
        assert time.monotonic() < deadline, values
        time.sleep(0.05)


def test_client_disconnects_abort_and_free_blocks(served):
    url, _ = served
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        before = _abort_count(client)
        stream = _stream_lines(client, {"prompt": "hello", "max_tokens": 500, "ignore_eos": True})
        next(stream)
        stream.close()  # the connection closes mid-stream
        _wait_idle_with_aborts(client, before + 1)
        # a non-streaming client that hangs up while its request runs
        body = json.dumps({"prompt": "hello", "max_tokens": 500, "ignore_eos": True}).encode()
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nAuthorization: " + AUTH["Authorization"].encode()
                        + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            deadline = time.monotonic() + 10
            while metric_values(client.get("/metrics").text)[
                    ("omniinfer:num_requests_running", ())] == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
        _wait_idle_with_aborts(client, before + 2)


def test_bench_serve_against_the_server(served, capsys):
    from omniinfer.entrypoints.cli import main

    url, _ = served
    # (64 tokens a request: the server merges the outputs a reader has not taken yet, and twice in
    # CI every request's 5, then 16, tokens came in its first chunk: no gap to time. The tiny
    # model makes 16 tokens in about one GIL switch interval of the server's engine thread.)
    assert main(["bench", "serve", "--base-url", url, "--api-key", KEY, "--num-prompts", "6",
                 "--input-len", "8", "--output-len", "64", "--max-concurrency", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["model"], r["completed"], r["failed"]) == ("tiny", 6, 0)
    assert r["input_tokens"] == 6 * 8 and r["output_tokens"] == 6 * 64
    assert r["ttft_s"]["count"] == 6 and r["e2e_s"]["p50"] >= r["ttft_s"]["p50"] > 0
    assert r["itl_s"]["count"] > 0 and r["requests_per_s"] > 0
    assert main(["bench", "serve", "--base-url", url, "--api-key", KEY, "--num-prompts", "2",
                 "--output-len", "3", "--request-rate", "20"]) == 0
    text = capsys.readouterr().out
    assert "2/2 requests" in text and "requests/s" in text and "TTFT" in text and "ITL" in text


def test_bench_serve_reports_failures(served, capsys):
    from omniinfer.entrypoints.cli import main

    url, _ = served
    assert main(["bench", "serve", "--base-url", url, "--api-key", KEY, "--model", "tiny",
                 "--num-prompts", "2", "--output-len", "1000"]) == 1  # longer than max_model_len
    assert "2 of 2 requests failed" in capsys.readouterr().err


def test_stats_log_line_while_serving(served):
    url, log = served
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        threads = [threading.Thread(target=client.post, args=("/v1/completions",), kwargs={
            "json": {"prompt": "hi", "max_tokens": 40, "ignore_eos": True}}) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    deadline = time.monotonic() + 10
    while "generation throughput" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    line = next(line for line in log.read_text().splitlines() if "generation throughput" in line)
    assert "running:" in line and "waiting:" in line and "KV cache usage:" in line
