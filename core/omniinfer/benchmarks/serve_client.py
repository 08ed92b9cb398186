"""A client load against a running OpenAI-compatible server (`omniinfer bench serve`).

Every request streams POST /v1/completions, so the client sees each chunk arrive: TTFT is
the time to the first chunk with text, ITL the gaps between later chunks, E2E the time to
[DONE]. Requests start all at once (bounded by `max_concurrency`) or as a Poisson process
at `request_rate` requests/s.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from omniinfer.benchmarks.stats import summarize

_POOL_TEXT = (
    "Return the number of items in a container. This module provides functions for working "
    "with paths, files and directories. Raise ValueError if the argument is not valid. The "
    "default value is None; a cache maps keys to values and is cleared when it grows too large."
)


@dataclass
class RequestResult:
    is_ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def served_model(client, api_key: str | None) -> str:
    response = await client.get("/v1/models", headers=_headers(api_key))
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def random_prompts(client, api_key: str | None, num_prompts: int, input_len: int,
                         seed: int = 0) -> list:
    """Prompts of `input_len` token ids drawn from the server's own tokenization of some text
    (POST /tokenize); plain text of about that many words if the server lacks /tokenize."""
    rng = random.Random(seed)
    response = await client.post("/tokenize", json={"prompt": _POOL_TEXT, "add_special_tokens": False},
                                 headers=_headers(api_key))
    if response.status_code == 200 and response.json().get("tokens"):
        pool = response.json()["tokens"]
        return [[rng.choice(pool) for _ in range(input_len)] for _ in range(num_prompts)]
    words = _POOL_TEXT.split()
    return [" ".join(rng.choice(words) for _ in range(input_len)) for _ in range(num_prompts)]


async def _one(client, payload: dict, api_key: str | None) -> RequestResult:
    result = RequestResult()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=payload,
                                 headers=_headers(api_key)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return result
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
    except Exception as e:  # noqa: BLE001 - counted as a failed request
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.is_ok = True
    return result


async def run(base_url: str, *, model: str | None = None, prompts: list | None = None,
              num_prompts: int = 32, input_len: int = 32, output_len: int = 32,
              max_concurrency: int = 8, request_rate: float = float("inf"),
              api_key: str | None = None, seed: int = 0, timeout_s: float = 600.0) -> dict:
    """Send the load and return the summary (requests/s, tokens/s, TTFT/ITL/E2E percentiles)."""
    import httpx

    if max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
    limits = httpx.Limits(max_connections=max_concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        model = model or await served_model(client, api_key)
        if prompts is None:
            prompts = await random_prompts(client, api_key, num_prompts, input_len, seed)
        rng = random.Random(seed)
        gate = asyncio.Semaphore(max_concurrency)

        async def limited(prompt) -> RequestResult:
            async with gate:
                return await _one(client, {
                    "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                }, api_key)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.is_ok]
    num_out = sum(r.output_tokens for r in ok)
    return {
        "model": model, "num_requests": len(results), "completed": len(ok),
        "failed": len(results) - len(ok), "errors": [r.error for r in results if r.error][:5],
        "duration_s": duration, "requests_per_s": len(ok) / duration,
        "input_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": num_out,
        "output_tokens_per_s": num_out / duration,
        "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s": summarize([gap for r in ok for gap in r.itl_s]),
        "e2e_s": summarize([r.e2e_s for r in ok]),
    }
