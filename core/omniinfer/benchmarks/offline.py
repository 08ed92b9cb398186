"""Offline benchmarks on the `LLM` API: throughput of a batch of prompts, latency of a batch."""

from __future__ import annotations

import random
import time

from omniinfer.benchmarks.stats import summarize
from omniinfer.sampling.params import SamplingParams


def random_prompts(tokenizer, vocab_size: int, num_prompts: int, input_len: int,
                   seed: int = 0) -> list[dict]:
    """`num_prompts` prompts of exactly `input_len` random token ids (special tokens excluded)."""
    if input_len < 1 or num_prompts < 1:
        raise ValueError(f"input_len={input_len} and num_prompts={num_prompts} must be >= 1")
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pool = [t for t in range(vocab_size) if t not in special]
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.choice(pool) for _ in range(input_len)]}
            for _ in range(num_prompts)]


def read_prompts(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f if line.strip()]


def bench_params(output_len: int, temperature: float = 0.0, seed: int | None = None) -> SamplingParams:
    """Exactly `output_len` tokens per request (EOS ignored), so runs are comparable."""
    return SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True, seed=seed)


def request_latencies(outputs) -> dict:
    """TTFT, TPOT (time per output token after the first) and E2E per request, summarized."""
    ttft, tpot, e2e = [], [], []
    for out in outputs:
        m = out.metrics
        if m.get("finished_time") is None or m.get("first_token_time") is None:
            continue
        ttft.append(m["first_token_time"] - m["arrival_time"])
        e2e.append(m["finished_time"] - m["arrival_time"])
        n = max(len(c.token_ids) for c in out.outputs)
        if n > 1:
            tpot.append((m["finished_time"] - m["first_token_time"]) / (n - 1))
    return {"ttft_s": summarize(ttft), "tpot_s": summarize(tpot), "e2e_s": summarize(e2e)}


def throughput(llm, prompts: list, params: SamplingParams) -> dict:
    """All prompts at once through `llm.generate`: requests/s and tokens/s."""
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"num_requests": len(outputs), "elapsed_s": elapsed,
            "input_tokens": num_in, "output_tokens": num_out,
            "requests_per_s": len(outputs) / elapsed,
            "total_tokens_per_s": (num_in + num_out) / elapsed,
            "output_tokens_per_s": num_out / elapsed,
            **request_latencies(outputs)}


def latency(llm, prompts: list, params: SamplingParams, *, num_iters: int = 5,
            num_warmup: int = 1) -> dict:
    """Time `num_iters` runs of one batch (after `num_warmup` untimed runs)."""
    if num_iters < 1 or num_warmup < 0:
        raise ValueError(f"num_iters={num_iters} must be >= 1 and num_warmup={num_warmup} >= 0")
    for _ in range(num_warmup):
        llm.generate(prompts, params, use_tqdm=False)
    times, per_request = [], []
    for _ in range(num_iters):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        per_request += outputs
    num_out = sum(len(c.token_ids) for o in per_request for c in o.outputs)
    return {"batch_size": len(prompts), "num_iters": num_iters, "latency_s": summarize(times),
            "output_tokens_per_s": num_out / sum(times), **request_latencies(per_request)}
