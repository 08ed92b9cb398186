"""Memory soak (issue 18, slow tier): the server's RSS after 200, 1,000 and 2,000 requests of
every kind (whole and streamed completions and chats, n > 1, logprobs, seeds, clients that
leave mid-stream, refused requests, a 1 MiB prompt every 100) levels off.

On main before issue 18 the 1 MiB prompts were tokenized whole (and a 21 MB one added 2.7 GB
that stayed); now they are refused after a prefix, and RSS stays within a few MiB once the
first few hundred requests have warmed the allocator up.
`python tests/test_soak.py [MODEL] [REQUESTS]` runs it by hand and prints the same figures.
"""

from __future__ import annotations

import asyncio
import random
import sys

import httpx
import pytest

MARKS = (200, 1000, 2000)
MESSAGES = [{"role": "user", "content": "What does os.path.join do?"}]
BIG = "Return the number of items. " * ((1 << 20) // 28)


def request(i: int, rng: random.Random) -> tuple[str, dict]:
    if i % 100 == 50:
        return "/v1/completions", {"prompt": BIG, "max_tokens": 4}  # refused: too long
    kind = i % 6
    if kind == 0:
        return "/v1/completions", {"prompt": "Return the number " * rng.randint(1, 60),
                                   "max_tokens": rng.randint(1, 32)}
    if kind == 1:
        return "/v1/completions", {"prompt": "def main", "max_tokens": 16, "stream": True,
                                   "temperature": 0.8, "seed": i}
    if kind == 2:
        return "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16, "logprobs": True,
                                        "top_logprobs": 3}
    if kind == 3:
        return "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 16, "stream": True,
                                        "stream_options": {"include_usage": True}}
    if kind == 4:
        return "/v1/completions", {"prompt": ["a b", "c d"], "n": 2, "max_tokens": 8,
                                   "logprobs": 2, "top_k": 20}
    return "/v1/completions", {"prompt": "hi", "top_k": 2**63}  # refused: out of range


async def soak(url: str, rss_mib, total: int = 2000, concurrency: int = 16) -> dict[int, float]:
    """Send `total` requests; {count: RSS in MiB} at each of MARKS."""
    rng = random.Random(0)
    done = 0
    figures: dict[int, float] = {}
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(i: int) -> None:
            nonlocal done
            async with limit:
                path, body = request(i, rng)
                if body.get("stream"):
                    async with client.stream("POST", path, json=body) as r:
                        assert r.status_code == 200
                        lines = 0
                        async for _ in r.aiter_lines():
                            lines += 1
                            if i % 12 == 1 and lines > 3:
                                break  # a client that leaves mid-stream
                else:
                    r = await client.post(path, json=body)
                    assert r.status_code in (200, 400), r.text
                done += 1
                if done in MARKS:
                    figures[done] = rss_mib()
                    print(f"after {done} requests: RSS {figures[done]:.0f} MiB", flush=True)

        await asyncio.gather(*(one(i) for i in range(total)))
    return figures


@pytest.mark.slow
def test_memory_levels_off(checkpoint_dir, tmp_path):
    from test_openai_server import CHAT_TEMPLATE
    from test_serve_lifecycle import Served

    template = tmp_path / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    served = Served(checkpoint_dir("llama"), tmp_path / "server.log", "--num-kv-blocks", "256",
                    "--block-size", "8", "--max-model-len", "512", "--chat-template",
                    str(template))
    try:
        print(f"\nstart: RSS {served.rss_mib():.0f} MiB")
        figures = asyncio.run(soak(served.url, served.rss_mib))
        assert served.proc.poll() is None
    finally:
        assert served.stop() == 0
    assert figures[2000] - figures[200] < 40, figures  # measured: +5 MiB
    assert figures[2000] - figures[1000] < 20, figures


if __name__ == "__main__":
    import os
    import tempfile
    from pathlib import Path

    sys.path.insert(0, os.path.dirname(__file__))
    from test_serve_lifecycle import Served

    from omniinfer.entrypoints.cli_generate import default_model

    with tempfile.TemporaryDirectory() as tmp:
        s = Served(sys.argv[1] if len(sys.argv) > 1 else default_model(), Path(tmp) / "log")
        try:
            print(f"start: RSS {s.rss_mib():.0f} MiB")
            asyncio.run(soak(s.url, s.rss_mib, int(sys.argv[2]) if len(sys.argv) > 2 else 2000))
        finally:
            s.stop()
