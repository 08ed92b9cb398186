"""Offline throughput: N prompts of random token ids, all submitted at once, EOS ignored.

Reports requests/s, output and total tokens/s, and model FLOP utilisation (achieved model
FLOP/s over the matmul peak this script measures first with torch at the workload's
shapes and dtype). `--compare transformers` runs transformers on the same checkpoint and
workload in the same process: static batching at its best batch size among 8/32/64, and
its continuous-batching mode where the installed version has one.

    python benchmarks/throughput.py --shape small --dtype float32 [--compare transformers]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import SHAPES, build_random_checkpoint, model_flops, quiet  # noqa: E402

DEFAULTS = {"small": (64, 128, 128), "medium": (32, 128, 64)}


def matmul_peak(shape: dict, dtype: torch.dtype, rows: list[int], seconds: float = 0.5) -> float:
    """Best GFLOP/s of x @ W over the workload's linear shapes (W stored [out, in])."""
    h, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    best = 0.0
    for m in rows:
        for k, n in ((h, 2 * inter), (inter, h), (h, vocab)):
            x = torch.randn(m, k, dtype=dtype)
            w = torch.randn(n, k, dtype=dtype)
            torch.nn.functional.linear(x, w)
            count, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 3:
                torch.nn.functional.linear(x, w)
                count += 1
            best = max(best, 2 * m * k * n * count / (time.perf_counter() - t0) / 1e9)
    return best


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run_omniinfer(path: str, prompts, output_len: int, dtype: str, engine_args: dict) -> float:
    from omniinfer import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_num_seqs=len(prompts), max_model_len=2048, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    llm.llm_engine.shutdown()
    return elapsed


def run_transformers_static(path: str, prompts, output_len: int, dtype: torch.dtype,
                            batch: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=2, do_sample=False, eos_token_id=None, pad_token_id=0)
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = ids[i:i + batch]
            out = model.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            assert out.shape[1] == chunk.shape[1] + output_len
    return time.perf_counter() - t0


def run_transformers_continuous(path: str, prompts, output_len: int, dtype: torch.dtype) -> float | None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    if not hasattr(model, "generate_batch"):
        return None
    config = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("-n", "--num-prompts", type=int)
    parser.add_argument("--input-len", type=int)
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--compare", choices=["transformers"])
    parser.add_argument("--model", help="an existing checkpoint instead of a random one")
    parser.add_argument("--json", help="append the result to this JSON file")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    n, i, o = DEFAULTS.get(args.shape, (64, 128, 128))
    n, i, o = args.num_prompts or n, args.input_len or i, args.output_len or o
    dtype = getattr(torch, args.dtype)
    shape = SHAPES[args.shape]
    quiet()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_random_checkpoint(os.path.join(tmp, args.shape), args.shape, args.dtype)
        prompts = make_prompts(n, i, shape["vocab_size"])
        peak = matmul_peak(shape, dtype, [n, args.max_num_batched_tokens])
        flops = model_flops(shape, n, i, o)
        elapsed = run_omniinfer(path, prompts, o, args.dtype,
                                {"max_num_batched_tokens": args.max_num_batched_tokens})
        result = {
            "shape": args.shape, "dtype": args.dtype, "num_prompts": n, "input_len": i, "output_len": o,
            "threads": torch.get_num_threads(), "matmul_peak_gflops": peak,
            "omniinfer": {"seconds": elapsed, "requests_per_s": n / elapsed,
                          "output_tokens_per_s": n * o / elapsed, "total_tokens_per_s": n * (i + o) / elapsed,
                          "model_gflops": flops / elapsed / 1e9, "mfu": flops / elapsed / 1e9 / peak},
        }
        if args.compare == "transformers":
            batches = [b for b in (8, 32, 64) if b <= n] or [n]
            static = {b: run_transformers_static(path, prompts, o, dtype, b) for b in batches}
            best = min(static, key=static.get)
            result["transformers_static"] = {"best_batch": best, "seconds": static[best],
                                             "output_tokens_per_s": n * o / static[best],
                                             "all_batches_s": static}
            cont = run_transformers_continuous(path, prompts, o, dtype)
            if cont is not None:
                result["transformers_continuous"] = {"seconds": cont, "output_tokens_per_s": n * o / cont}
    print_table(result)
    if args.json:
        append_json(args.json, result)


def print_table(r: dict) -> None:
    print(f"throughput: {r['shape']} {r['dtype']}  N={r['num_prompts']} I={r['input_len']} "
          f"O={r['output_len']}  threads={r['threads']}  matmul peak {r['matmul_peak_gflops']:.0f} GFLOP/s")
    e = r["omniinfer"]
    print(f"  omniinfer            {e['output_tokens_per_s']:8.0f} out tok/s  {e['total_tokens_per_s']:8.0f} "
          f"total tok/s  {e['requests_per_s']:6.2f} req/s  MFU {100 * e['mfu']:5.1f}%")
    for key, label in (("transformers_static", "transformers static"),
                       ("transformers_continuous", "transformers cont.")):
        if key in r:
            t = r[key]
            extra = f" (batch {t['best_batch']})" if "best_batch" in t else ""
            print(f"  {label:<20} {t['output_tokens_per_s']:8.0f} out tok/s{extra}  -> omniinfer is "
                  f"{e['output_tokens_per_s'] / t['output_tokens_per_s']:.2f}x")


def append_json(path: str, result: dict) -> None:
    rows = []
    if os.path.isfile(path):
        with open(path) as f:
            rows = json.load(f)
    rows.append(result)
    with open(path, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
