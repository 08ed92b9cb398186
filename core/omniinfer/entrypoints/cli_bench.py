"""`omniinfer bench throughput | latency | serve`: quick measurements from the command line.

The measuring code lives in `omniinfer.benchmarks` (reusable from scripts); this module only
parses flags and prints. Offline runs ignore EOS so every request makes exactly
--output-len tokens.
"""

from __future__ import annotations

import argparse
import json
import sys

from omniinfer.benchmarks.perf import SHAPES
from omniinfer.entrypoints.cli_generate import default_model
from omniinfer.entrypoints.engine_flags import add_engine_args, engine_kwargs, env_default


def register(sub) -> None:
    bench = sub.add_parser("bench", help="measure throughput and latency (offline or a server)")
    kinds = bench.add_subparsers(dest="bench_command", metavar="KIND", required=True)

    t = kinds.add_parser("throughput", help="offline: many prompts at once; tokens/s")
    _offline_args(t)
    t.add_argument("--num-prompts", type=int, default=None, help="default 32 (or the --shape workload's)")
    t.add_argument("--prompts-file", help="one prompt per line (default: random token ids)")
    t.add_argument("--repeats", type=int, default=1,
                   help="with --shape/--compare: timed runs of each configuration; the median counts")
    t.set_defaults(func=run_throughput)

    lat = kinds.add_parser("latency", help="offline: one batch, timed over several iterations")
    _offline_args(lat)
    lat.add_argument("--batch-size", type=int, default=4)
    lat.add_argument("--num-iters", type=int, default=5)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.set_defaults(func=run_latency)

    s = kinds.add_parser("serve", help="a streaming client load against a running server")
    s.add_argument("--base-url", default=env_default("base_url", "http://127.0.0.1:8000"))
    s.add_argument("--model", default=None, help="model id to request (default: the server's)")
    s.add_argument("--api-key", default=env_default("api_key", None))
    s.add_argument("--num-prompts", type=int, default=32)
    s.add_argument("--input-len", type=int, default=32)
    s.add_argument("--output-len", type=int, default=32)
    s.add_argument("--prompts-file", help="one prompt per line (default: random token ids)")
    s.add_argument("--max-concurrency", type=int, default=8)
    s.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s as a Poisson process (default: all at once)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.set_defaults(func=run_serve)


def _offline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=env_default("model", None) or default_model(),
                   help="checkpoint directory (default: the shipped demo model)")
    p.add_argument("--input-len", type=int, default=None, help="default 32 (or the --shape workload's)")
    p.add_argument("--output-len", type=int, default=None, help="default 32 (or the --shape workload's)")
    p.add_argument("--shape", choices=sorted(SHAPES),
                   help="the performance workloads: a random checkpoint of this shape, model FLOP "
                        "utilisation / weight bandwidth against this machine's measured peaks")
    p.add_argument("--compare", choices=["transformers", "llama.cpp"], action="append",
                   help="also run transformers (or llama.cpp, optional: its llama-bench / "
                        "llama-batched-bench) on the same weights and workload, and print ratios")
    p.add_argument("--llama-cpp-bin", help="the directory of llama.cpp's tools (else $LLAMA_CPP_BIN, PATH)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_engine_args(p)


def _llm(args):
    from omniinfer import LLM

    if not args.model:
        raise SystemExit("error: no --model given and no demo model is installed")
    return LLM(args.model, **engine_kwargs(args))


def _print(args, result: dict, lines: list[str]) -> int:
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("\n".join(lines))
    return 0


def _perf_dtype(args) -> str:
    return "float32" if args.dtype in (None, "auto") else args.dtype


def run_throughput(args) -> int:
    from omniinfer.benchmarks import offline, perf
    from omniinfer.benchmarks.stats import latency_table

    if args.repeats < 1:
        raise SystemExit(f"error: --repeats {args.repeats}: expected a positive number of runs")
    if args.shape or args.compare:  # the performance suite (benchmarks/throughput.py)
        perf.quiet()
        perf.unwind_on_sigterm()
        r = perf.throughput(args.shape, _perf_dtype(args), args.num_prompts, args.input_len,
                            args.output_len, args.compare, None if args.shape else args.model,
                            args.max_num_batched_tokens or 2048, args.repeats,
                            args.num_scheduler_steps, args.llama_cpp_bin)
        return _print(args, r, [perf.throughput_table(r)])
    args.num_prompts = args.num_prompts or 32
    args.input_len, args.output_len = args.input_len or 32, args.output_len or 32
    llm = _llm(args)
    prompts = (offline.read_prompts(args.prompts_file) if args.prompts_file else
               offline.random_prompts(llm.get_tokenizer(), llm.llm_engine.config.model.vocab_size,
                                      args.num_prompts, args.input_len, args.seed))
    r = offline.throughput(llm, prompts, offline.bench_params(args.output_len, args.temperature))
    return _print(args, r, [
        f"throughput: {r['requests_per_s']:.2f} requests/s, {r['total_tokens_per_s']:.1f} "
        f"tokens/s total, {r['output_tokens_per_s']:.1f} output tokens/s",
        f"  {r['num_requests']} requests, {r['input_tokens']} input + {r['output_tokens']} output "
        f"tokens in {r['elapsed_s']:.2f} s",
        latency_table({"TTFT": r["ttft_s"], "TPOT": r["tpot_s"], "E2E": r["e2e_s"]})])


def run_latency(args) -> int:
    from omniinfer.benchmarks import offline, perf
    from omniinfer.benchmarks.stats import latency_table

    if args.shape or args.compare:  # the performance suite (benchmarks/latency.py): batch 1
        perf.quiet()
        perf.unwind_on_sigterm()
        r = perf.latency(args.shape, _perf_dtype(args), args.input_len or 128, args.output_len or 64,
                         args.num_iters, args.compare, None if args.shape else args.model,
                         args.llama_cpp_bin)
        return _print(args, r, [perf.latency_table(r)])
    args.input_len, args.output_len = args.input_len or 32, args.output_len or 32
    llm = _llm(args)
    prompts = offline.random_prompts(llm.get_tokenizer(), llm.llm_engine.config.model.vocab_size,
                                     args.batch_size, args.input_len, args.seed)
    r = offline.latency(llm, prompts, offline.bench_params(args.output_len, args.temperature),
                        num_iters=args.num_iters, num_warmup=args.num_iters_warmup)
    return _print(args, r, [
        f"latency of a batch of {r['batch_size']} ({args.input_len} input, {args.output_len} "
        f"output tokens each), {r['num_iters']} iterations: avg {r['latency_s']['mean']:.3f} s, "
        f"{r['output_tokens_per_s']:.1f} output tokens/s",
        latency_table({"batch": r["latency_s"], "TTFT": r["ttft_s"], "TPOT": r["tpot_s"]})])


def run_serve(args) -> int:
    import asyncio

    from omniinfer.benchmarks import serve_client
    from omniinfer.benchmarks.offline import read_prompts
    from omniinfer.benchmarks.stats import latency_table

    prompts = read_prompts(args.prompts_file) if args.prompts_file else None
    r = asyncio.run(serve_client.run(
        args.base_url.rstrip("/"), model=args.model, prompts=prompts, num_prompts=args.num_prompts,
        input_len=args.input_len, output_len=args.output_len, max_concurrency=args.max_concurrency,
        request_rate=args.request_rate, api_key=args.api_key, seed=args.seed))
    _print(args, r, [
        f"serving {r['model']} at {args.base_url}: {r['completed']}/{r['num_requests']} requests "
        f"in {r['duration_s']:.2f} s: {r['requests_per_s']:.2f} requests/s, "
        f"{r['output_tokens_per_s']:.1f} output tokens/s",
        latency_table({"TTFT": r["ttft_s"], "ITL": r["itl_s"], "E2E": r["e2e_s"]})]
        + [f"error: {e}" for e in r["errors"]])
    if r["failed"]:
        print(f"error: {r['failed']} of {r['num_requests']} requests failed", file=sys.stderr)
        return 1
    return 0
