"""Attention-kernel micro-benchmark: every backend the platform can run, one layer's forward
(KV write + attention) for a decode batch, a prompt batch and a chunk over a paged prefix.

    python benchmarks/attention_kernels.py [--platform cuda] [--backend NAME ...]
                                           [--dtype bfloat16] [--json out.json]

Shapes are one Llama-3-8B layer (32 query heads, 8 KV heads, head size 128, block size 16) on
accelerators and a tiny layer on the CPU. Numbers are tokens per second through
``impl.forward`` launched eagerly (decode graphs, which the engine replays on CUDA and ROCm,
are not used here). Interpreted Triton on the CPU is skipped unless --include-interpreted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

GPU_SHAPE = dict(num_kv_heads=8, group=4, head_size=128, block_size=16)
CPU_SHAPE = dict(num_kv_heads=2, group=2, head_size=64, block_size=16)
# (label, [(context_len, query_len)] per sequence)
GPU_WORKLOADS = [("decode", [(1023, 1)] * 64), ("prefill", [(0, 512)] * 4),
                 ("chunked", [(1536, 512)] * 2)]
CPU_WORKLOADS = [("decode", [(127, 1)] * 8), ("prefill", [(0, 64)] * 2), ("chunked", [(96, 32)] * 2)]


def bench_one(backend, workload, shape, device, dtype, synchronize, iters: int) -> float:
    """Tokens per second of one forward call over `workload`."""
    from omniinfer.testing.conformance.cases import Case, build_metadata

    case = Case("bench", tuple(workload), **shape)
    seqs = case.ordered()
    blocks = [-(-(c + q) // case.block_size) for c, q in seqs]
    tables, start = [], 0
    for n in blocks:
        tables.append(list(range(start, start + n)))
        start += n
    kv = torch.randn(backend.get_kv_cache_shape(start, case.block_size, case.num_kv_heads,
                                                case.head_size), device=device).to(dtype)
    md = build_metadata(backend, case, seqs, tables).to(device)
    num_tokens = sum(q for _, q in seqs)
    q = torch.randn(num_tokens, case.num_heads * case.head_size, device=device).to(dtype)
    k = torch.randn(num_tokens, case.num_kv_heads * case.head_size, device=device).to(dtype)
    impl = backend.get_impl_cls()(case.num_heads, case.head_size, case.head_size ** -0.5,
                                  case.num_kv_heads, None)
    with torch.inference_mode():
        for _ in range(2):
            impl.forward(q, k, k, kv, md)
        synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            impl.forward(q, k, k, kv, md)
        synchronize()
    return num_tokens * iters / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", default=None)
    parser.add_argument("--backend", action="append", default=[])
    parser.add_argument("--dtype", default=None, help="default: each backend's conformance dtype, "
                                                      "bfloat16 when it runs it")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--include-interpreted", action="store_true")
    args = parser.parse_args(argv)

    from omniinfer.kernels.triton import interpret_requested
    from omniinfer.platforms.registry import get_registry
    from omniinfer.testing.conformance.plugin import discover

    platform = get_registry().select_platform(args.platform)
    run = discover(platform, args.backend)
    on_cpu = platform.device_type == "cpu"
    shape, workloads = (CPU_SHAPE, CPU_WORKLOADS) if on_cpu else (GPU_SHAPE, GPU_WORKLOADS)
    iters = args.iters or (3 if on_cpu else 20)
    results = []
    for name, conformance_dtype in run.runnable.items():
        backend = run.classes[name]
        if on_cpu and interpret_requested() and name == "TRITON" and not args.include_interpreted:
            results.append(dict(backend=name, skipped="interpreted Triton (--include-interpreted)"))
            continue
        dtype = getattr(torch, args.dtype) if args.dtype else conformance_dtype
        if not args.dtype and not backend.validate(run.spec(torch.bfloat16)) and not on_cpu:
            dtype = torch.bfloat16
        row = dict(backend=name, dtype=str(dtype).removeprefix("torch."))
        for label, workload in workloads:
            try:
                row[label] = bench_one(backend, workload, shape, run.device, dtype,
                                       platform.synchronize, iters)
            except Exception as e:  # one backend's failure must not hide the others' numbers
                row[label] = None
                row.setdefault("errors", []).append(f"{label}: {type(e).__name__}: {e}")
        results.append(row)

    labels = [label for label, _ in workloads]
    from omniinfer.benchmarks.perf import machine_line

    print(machine_line())
    print(f"attention kernels on {platform.name} ({run.device}), tokens/s per layer forward")
    print(f"{'backend':<12} {'dtype':<9} " + " ".join(f"{lb:>12}" for lb in labels))
    for row in results:
        if "skipped" in row:
            print(f"{row['backend']:<12} skipped: {row['skipped']}")
            continue
        cells = [f"{row[lb]:>12,.0f}" if row.get(lb) else f"{'error':>12}" for lb in labels]
        print(f"{row['backend']:<12} {row['dtype']:<9} " + " ".join(cells))
        for error in row.get("errors", []):
            print(f"    {error}")
    for name, reasons in run.refused.items():
        print(f"{name:<12} not runnable: {' | '.join(reasons)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(platform=platform.name, results=results, refused=run.refused), f, indent=1)
    return 1 if any("errors" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
