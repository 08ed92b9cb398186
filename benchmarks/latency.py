"""Batch-1 latency: time to first token, ms per output token, and the weight bandwidth that
implies, next to the copy bandwidth this script measures first.

    python benchmarks/latency.py --shape medium --dtype float32 [--compare transformers]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import SHAPES, build_random_checkpoint, quiet  # noqa: E402
from throughput import append_json, make_prompts  # noqa: E402


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> dict:
    """GB/s of a torch copy (bytes read + written) and of a sum (bytes read)."""
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    copies, sums = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * num_bytes / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        src.sum()
        sums.append(num_bytes / (time.perf_counter() - t0) / 1e9)
    return {"copy_gbps": statistics.median(copies), "read_gbps": statistics.median(sums)}


def weight_bytes(shape: dict, dtype: torch.dtype) -> int:
    """Bytes read per decoded token: every linear weight plus the LM head (tied or not)."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    head = h // heads
    per_layer = h * (heads + 2 * kv) * head + heads * head * h + 3 * h * shape["intermediate_size"]
    params = per_layer * layers + h * shape["vocab_size"]
    return params * torch.empty((), dtype=dtype).element_size()


def run_omniinfer(path: str, prompt: list[int], output_len: int, dtype: str, repeats: int) -> dict:
    from omniinfer import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_num_seqs=1, max_model_len=2048)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    ttfts, per_token = [], []
    for r in range(repeats):
        engine.add_request(f"lat{r}", {"prompt_token_ids": prompt}, params)
        t0 = time.perf_counter()
        stamps = []
        while engine.has_unfinished_requests():
            engine.step()
            stamps.append(time.perf_counter())
        ttfts.append(stamps[0] - t0)
        per_token.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    engine.shutdown()
    return {"ttft_ms": 1e3 * statistics.median(ttfts), "ms_per_token": 1e3 * statistics.median(per_token)}


def run_transformers(path: str, prompt: list[int], output_len: int, dtype: torch.dtype, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor([prompt])
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    ttfts, per_token = [], []
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, **kwargs)
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, **kwargs)
            ttft = time.perf_counter() - t0
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kwargs)
            total = time.perf_counter() - t0
            ttfts.append(ttft)
            per_token.append((total - ttft) / (output_len - 1))
    return {"ttft_ms": 1e3 * statistics.median(ttfts), "ms_per_token": 1e3 * statistics.median(per_token)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="medium")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", choices=["transformers"])
    parser.add_argument("--model")
    parser.add_argument("--json")
    args = parser.parse_args()
    quiet()
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    bandwidth = copy_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_random_checkpoint(os.path.join(tmp, args.shape), args.shape, args.dtype)
        prompt = make_prompts(1, args.input_len, shape["vocab_size"])[0]
        ours = run_omniinfer(path, prompt, args.output_len, args.dtype, args.repeats)
        result = {"shape": args.shape, "dtype": args.dtype, "input_len": args.input_len,
                  "output_len": args.output_len, "threads": torch.get_num_threads(), **bandwidth,
                  "weight_bytes": weight_bytes(shape, dtype), "omniinfer": ours}
        ours["weight_gbps"] = result["weight_bytes"] / ours["ms_per_token"] / 1e6
        if args.compare == "transformers":
            theirs = run_transformers(path, prompt, args.output_len, dtype, args.repeats)
            theirs["weight_gbps"] = result["weight_bytes"] / theirs["ms_per_token"] / 1e6
            result["transformers"] = theirs
    print(f"latency: {args.shape} {args.dtype}  I={args.input_len} O={args.output_len}  threads="
          f"{result['threads']}  copy {bandwidth['copy_gbps']:.1f} GB/s, read {bandwidth['read_gbps']:.1f} GB/s, "
          f"weights {result['weight_bytes'] / 1e9:.2f} GB/token")
    for name in ("omniinfer", "transformers"):
        if name in result:
            r = result[name]
            print(f"  {name:<13} TTFT {r['ttft_ms']:8.1f} ms  {r['ms_per_token']:7.2f} ms/token  "
                  f"weights at {r['weight_gbps']:5.1f} GB/s")
    if "transformers" in result:
        print(f"  decode speed-up over transformers: "
              f"{result['transformers']['ms_per_token'] / ours['ms_per_token']:.2f}x")
    if args.json:
        append_json(args.json, result)


if __name__ == "__main__":
    main()
