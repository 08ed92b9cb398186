"""Batch-1 latency: time to first token, ms per output token, and the weight bandwidth that
implies, next to the copy bandwidth this script measures first.

    python benchmarks/latency.py --shape medium --dtype float32 [--compare transformers]
    python benchmarks/latency.py --shape medium --dtype bfloat16 --fp8   # its FP8 (e4m3, 128 x 128) copy
"""

from __future__ import annotations

import argparse

from omniinfer.benchmarks.gguf_export import FILE_TYPES as GGUF_TYPES
from omniinfer.benchmarks.perf import (
    SHAPES,
    append_json,
    latency,
    latency_table,
    quiet,
    unwind_on_sigterm,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="medium")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", choices=["transformers", "llama.cpp"], action="append",
                        help="another engine on the same weights (repeatable); llama.cpp: optional, "
                             "needs its llama-bench / llama-batched-bench")
    parser.add_argument("--llama-cpp-bin", help="the directory of llama.cpp's tools (else $LLAMA_CPP_BIN, PATH)")
    parser.add_argument("--gguf", choices=GGUF_TYPES,
                        help="write the checkpoint as a GGUF file of this type and run that file")
    parser.add_argument("--fp8", action="store_true",
                        help="write the checkpoint as an FP8 one (e4m3, a scale per 128 x 128 block) and run that")
    parser.add_argument("--model", help="an existing checkpoint instead of a random one")
    parser.add_argument("--json", help="append the result to this JSON file")
    args = parser.parse_args()
    if args.output_len < 2:
        parser.error(f"--output-len {args.output_len}: ms per output token needs at least 2 tokens")
    quiet()
    unwind_on_sigterm()
    result = latency(None if args.model else args.shape, args.dtype, args.input_len, args.output_len, args.repeats,
                     args.compare, args.model, args.llama_cpp_bin, args.gguf, args.fp8)
    print(latency_table(result))
    if args.json:
        append_json(args.json, result)


if __name__ == "__main__":
    main()
