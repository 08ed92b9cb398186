"""Offline throughput: N prompts of random token ids, all submitted at once, EOS ignored.

Reports requests/s, output and total tokens/s, and model FLOP utilisation (achieved model
FLOP/s over the matmul peak this script measures first with torch at the workload's
shapes and dtype). `--compare transformers` runs transformers on the same checkpoint and
workload in the same process: static batching at its best batch size among 8/32/64, and
its continuous-batching mode where the installed version has one.

    python benchmarks/throughput.py --shape small --dtype float32 [--compare transformers] [--repeats 3]
        [--num-scheduler-steps 8]

omniinfer runs with the LLM class's default of 8 decode steps per schedule (multi-step
decoding) and, for comparison, with one; `--num-scheduler-steps K` sets the first (1: only the
single-step run). Every configuration (the engines, each transformers batch size, its continuous
batching) is set up and warmed up first; then they take turns, one run each per round, for
`--repeats` rounds, and each reports its median run.
"""

from __future__ import annotations

import argparse

from omniinfer.benchmarks.gguf_export import FILE_TYPES as GGUF_TYPES
from omniinfer.benchmarks.perf import (
    SHAPES,
    append_json,
    quiet,
    throughput,
    throughput_table,
    unwind_on_sigterm,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("-n", "--num-prompts", type=int)
    parser.add_argument("--input-len", type=int)
    parser.add_argument("--output-len", type=int)
    parser.add_argument("--compare", choices=["transformers", "llama.cpp"], action="append",
                        help="another engine on the same weights (repeatable); llama.cpp: optional, "
                             "needs its llama-bench / llama-batched-bench")
    parser.add_argument("--llama-cpp-bin", help="the directory of llama.cpp's tools (else $LLAMA_CPP_BIN, PATH)")
    parser.add_argument("--gguf", choices=GGUF_TYPES,
                        help="write the checkpoint as a GGUF file of this type; omniinfer and llama.cpp run that file")
    parser.add_argument("--model", help="an existing checkpoint instead of a random one")
    parser.add_argument("--json", help="append the result to this JSON file")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs of each configuration (after its warm-up); the median counts")
    parser.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="decode steps per schedule (multi-step decoding; default: the LLM "
                             "class's, 8); above 1 the single-step engine runs too")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected a positive number of runs")
    if args.num_scheduler_steps is not None and args.num_scheduler_steps < 1:
        parser.error(f"--num-scheduler-steps {args.num_scheduler_steps}: expected a positive number")
    quiet()
    unwind_on_sigterm()
    result = throughput(None if args.model else args.shape, args.dtype, args.num_prompts, args.input_len, args.output_len,
                        args.compare, args.model, args.max_num_batched_tokens, args.repeats,
                        args.num_scheduler_steps, args.llama_cpp_bin, args.gguf)
    print(throughput_table(result))
    if args.json:
        append_json(args.json, result)


if __name__ == "__main__":
    main()
