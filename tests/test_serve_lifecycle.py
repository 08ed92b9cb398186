"""Issue 18 over real sockets: `omniinfer serve` as a subprocess. Oversized heads and bad
bodies get an answer on a connection that stays usable; /health answers while a 15 MiB body
is parsed; a dead worker makes /health 503 within a second and the server exit 1; SIGTERM
lets running requests finish up to --shutdown-timeout, then ends the rest with an OpenAI
error (streams: an error event, then [DONE])."""

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
import pytest
from test_openai_server import metric_values

from omniinfer.entrypoints.cli_generate import default_model
from omniinfer.testing.processes import child_pids

CONSOLE_SCRIPT = Path(sys.executable).with_name("omniinfer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, model: str, log: Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIINFER_")}
        env.update(OMNIINFER_CPU_THREADS="1")
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [str(CONSOLE_SCRIPT), "serve", model, "--port", str(self.port),
                 "--uvicorn-log-level", "warning", "--stats-interval", "0", *flags],
                env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"never healthy:\n{log.read_text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) / 1024

    def raw(self, request: bytes, sock: socket.socket | None = None) -> tuple[int, dict, bytes]:
        """Send raw bytes (on `sock`, kept open, or a fresh connection); (status, headers, body)."""
        own = sock is None
        sock = sock or socket.create_connection(("127.0.0.1", self.port), timeout=30)
        try:
            sock.sendall(request)
            return read_response(sock)
        finally:
            if own:
                sock.close()

    def stop(self, sig=signal.SIGINT, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data[:200]!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def post_bytes(path: str, body: bytes, content_type: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@pytest.fixture(scope="module")
def served(checkpoint_dir, tmp_path_factory):
    s = Served(checkpoint_dir("llama"), tmp_path_factory.mktemp("lifecycle") / "server.log",
               "--num-kv-blocks", "64", "--block-size", "8", "--max-model-len", "512")
    yield s
    assert s.stop() == 0, s.log.read_text()


def openai_error(body: bytes) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---- item 8: a 1 MB URL, huge headers; item 4: the connection stays usable ----------------------
def test_oversized_request_heads_get_an_answer_not_a_reset(served):
    status, headers, body = served.raw(b"GET /" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 414 and openai_error(body)["code"] == "uri_too_long"
    status, _, body = served.raw(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (1 << 20)
                                 + b"\r\n\r\n")
    assert status == 431 and openai_error(body)
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_bad_bodies_keep_the_connection_usable(served):
    good = post_bytes("/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as sock:
        for bad, status in [
                (post_bytes("/v1/completions", b'{"prompt": "Return the\\ud800"}'), 400),
                (post_bytes("/tokenize", b'{"prompt": "\\ud800"}'), 400),
                (post_bytes("/v1/chat/completions", b'{"messages": [{"role": "user", '
                            b'"content": "\\udfff"}]}'), 400),
                (post_bytes("/v1/completions", b'{"prompt": "hi"}', "text/plain"), 415),
                (post_bytes("/v1/completions", b'{"prompt": "hi", "top_k": 9223372036854775808,'
                            b' "temperature": 1, "top_p": 0.9}'), 400)]:
            got, headers, body = served.raw(bad, sock)
            assert got == status and openai_error(body), body
            assert headers.get("connection") != "close"
            got, _, body = served.raw(good, sock)  # the same connection
            assert got == 200 and json.loads(body)["usage"]["completion_tokens"] == 2


# ---- item 2: a big body stalls nothing -------------------------------------------------------------
def test_health_answers_while_big_bodies_are_parsed(served):
    bodies = {
        "15 MiB text": json.dumps({"prompt": "Return the number of items. " * ((15 << 20) // 28),
                                   "max_tokens": 4}).encode(),
        "12 MB of strings": json.dumps({"prompt": ["ab"] * 2_000_000}).encode(),
        "11 MB of token ids": json.dumps({"prompt": list(range(1, 1_600_000))}).encode(),
        "21 MB": b'{"prompt": "' + b"a" * (21 << 20) + b'"}',
    }
    rss_before = served.rss_mib()
    with httpx.Client(base_url=served.url, timeout=10) as client:
        client.get("/health")
        for name, body in bodies.items():
            answer, latencies = [], []
            sender = threading.Thread(target=lambda b=body, out=answer: out.append(
                served.raw(post_bytes("/v1/completions", b))))
            start = time.monotonic()
            sender.start()
            while sender.is_alive():
                t = time.perf_counter()
                assert client.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.01)
            sender.join()
            elapsed = time.monotonic() - start
            latencies = latencies or [0.0]
            status, _, error = answer[0]
            assert status == (413 if name == "21 MB" else 400), error
            assert openai_error(error)["param"] in ("prompt", None)
            print(f"{name}: answered {status} in {elapsed:.2f} s; /health max "
                  f"{max(latencies) * 1000:.0f} ms over {len(latencies)} polls")
            # (the goal is 100 ms; on a shared 2-core machine one poll in a hundred can lose
            # the CPU for longer, so the bound on the worst one is looser: main took > 10 s)
            latencies.sort()
            assert elapsed < 10 and latencies[int(0.9 * (len(latencies) - 1))] < 0.1, latencies
            assert latencies[-1] < 1.0, (name, latencies)
    assert served.rss_mib() - rss_before < 150  # it was +2.7 GB for a 21 MB prompt


# ---- item 3: a dead worker ---------------------------------------------------------------------------
def _wait_status(url: str, status: int, timeout_s: float) -> float:
    start = time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == status:
                return time.monotonic() - start
        except httpx.TransportError:
            pass
        assert time.monotonic() - start < timeout_s, f"/health never answered {status}"
        time.sleep(0.02)


def _worker_pid(served: Served) -> int:
    (pid,) = child_pids(served.proc.pid)
    return pid


def test_a_worker_killed_while_idle(checkpoint_dir, tmp_path):
    served = Served(checkpoint_dir("llama"), tmp_path / "server.log", "--tensor-parallel-size",
                    "2", "--num-kv-blocks", "64")
    try:
        os.kill(_worker_pid(served), signal.SIGKILL)
        assert _wait_status(served.url, 503, 5) < 1.0
        assert served.proc.wait(timeout=30) == 1, served.log.read_text()
    finally:
        served.stop()
    assert "killed by signal 9" in served.log.read_text()


def test_a_worker_killed_while_busy_with_keep_alive(checkpoint_dir, tmp_path):
    served = Served(checkpoint_dir("llama"), tmp_path / "server.log", "--tensor-parallel-size",
                    "2", "--num-kv-blocks", "256", "--max-model-len", "512",
                    "--keep-alive-on-engine-death")
    events = []

    def stream() -> None:
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=30, json={
                "prompt": "hi", "max_tokens": 500, "ignore_eos": True, "stream": True}) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    try:
        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 20
        while not events:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(_worker_pid(served), signal.SIGKILL)
        assert _wait_status(served.url, 503, 5) < 1.0
        reader.join(30)
        assert events[-1] == "data: [DONE]"
        assert "engine" in json.loads(events[-2][len("data: "):])["error"]["message"]
        values = metric_values(httpx.get(f"{served.url}/metrics").text)
        assert values[("omniinfer:engine_dead", ())] == 1
        assert values[("omniinfer:num_requests_running", ())] == 0
        r = httpx.post(f"{served.url}/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 500 and openai_error(r.content)["code"] == "engine_dead"
        assert served.proc.poll() is None  # kept alive, as asked
    finally:
        code = served.stop(signal.SIGTERM)
    assert code == 1


# ---- item 6: graceful shutdown -------------------------------------------------------------------------
def test_sigterm_finishes_what_it_can_then_ends_the_rest(tmp_path):
    served = Served(default_model(), tmp_path / "server.log", "--shutdown-timeout", "1",
                    "--num-kv-blocks", "512")
    long = {"prompt": "Return the", "max_tokens": 1000, "ignore_eos": True}
    results: dict[str, object] = {}

    def whole(name: str, body: dict) -> None:
        r = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
        results[name] = (r.status_code, r.json())

    def streamed(name: str) -> None:
        with httpx.stream("POST", f"{served.url}/v1/completions", timeout=60,
                          json={**long, "stream": True}) as r:
            results[name] = [line for line in r.iter_lines() if line.startswith("data: ")]

    threads = [threading.Thread(target=whole, args=(f"whole{i}", long)) for i in range(2)]
    threads += [threading.Thread(target=streamed, args=(f"stream{i}",)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while metric_values(httpx.get(f"{served.url}/metrics").text)[
                ("omniinfer:num_requests_running", ())] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        short = threading.Thread(target=whole, args=("short", {"prompt": "hi", "max_tokens": 8,
                                                              "ignore_eos": True}))
        short.start()
        time.sleep(0.1)
        served.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        for t in [*threads, short]:
            t.join(30)
        assert served.proc.wait(timeout=30) == 0, served.log.read_text()
        assert 0.9 < time.monotonic() - start < 10
    finally:
        served.stop()
    status, body = results["short"]
    assert status == 200 and body["usage"]["completion_tokens"] == 8  # finished in time
    for i in range(2):
        status, body = results[f"whole{i}"]
        assert status == 503 and body["error"]["code"] == "server_shutting_down"
        events = results[f"stream{i}"]
        assert events[-1] == "data: [DONE]" and len(events) > 2
        error = json.loads(events[-2][len("data: "):])["error"]
        assert error["code"] == "server_shutting_down" and "shutdown timeout" in error["message"]
    with pytest.raises(httpx.TransportError):  # nothing listens any more
        httpx.get(f"{served.url}/health", timeout=2)


# ---- the last line, over a socket: a 500 keeps the connection --------------------------------------
def test_an_unhandled_error_is_a_500_on_a_connection_that_stays_usable(checkpoint_dir,
                                                                      monkeypatch):
    """uvicorn in a thread of this process, so a handler can be broken on purpose: Starlette
    re-raises what its 500 handler answered, and uvicorn then dropped the connection."""
    import uvicorn
    from test_openai_server import CHAT_TEMPLATE, make_engine

    from omniinfer.entrypoints.openai.api_server import ServerState, build_app
    from omniinfer.entrypoints.openai.http_guard import H11Protocol

    state = ServerState("tiny", chat_template=CHAT_TEMPLATE, stats_interval_s=0)
    state.attach(make_engine(checkpoint_dir("llama")))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port,
                                           log_level="warning", http=H11Protocol))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def broken(*args, **kwargs):
        raise KeyError("a bug in a handler")

    monkeypatch.setattr(state.ctx, "render_chat", broken)
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.05)
        chat = post_bytes("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')
        good = post_bytes("/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            for _ in range(2):
                status, headers, body = read_after(sock, chat)
                error = openai_error(body)
                assert status == 500 and "KeyError" in error["message"]
                assert headers.get("connection") != "close"
                status, _, body = read_after(sock, good)
                assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 2
    finally:
        server.should_exit = True
        thread.join(30)
        state.shutdown()


def read_after(sock: socket.socket, request: bytes) -> tuple[int, dict, bytes]:
    sock.sendall(request)
    return read_response(sock)
