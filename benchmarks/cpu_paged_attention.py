"""CPU_PAGED kernel micro-benchmark: one layer-step of decode and of prefill through
``omni_paged_attention``, built from one or more kernel sources for A/B runs.

    python benchmarks/cpu_paged_attention.py [--source DIR_A --source DIR_B] [--cache l3]
                                             [--dtype bfloat16] [--rounds 7] [--json out.json]

Shapes are the small benchmark model's heads (8 query heads, 4 KV heads, head size 32, block
size 16). Decode: 64 sequences of 128-255 cached tokens; prefill: 16 prompts of 128 tokens.
``--cache memory`` (default) spreads each sequence's blocks at random over four 128 MiB
caches, used in turn like the layers of a model, so the keys come from memory as in the engine;
``--cache l3`` uses one small cache that stays in L3 (the kernel's compute alone). Sources are
timed interleaved, round by round, and each result is first checked against a torch
reference. A source is a kernels' csrc directory (every .c file in it is built, as the plugin
does) or, for revisions before the split, the single cpu_kernels.c; an older one to compare with:
``git archive REV plugins/cpu/omniinfer_cpu/kernels/csrc | tar -x -C /tmp/old`` (same cache
layout only: the layout changed at 2ffa589).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_line  # noqa: E402

H, KVH, D, BS = 8, 4, 32, 16
LAYERS = 4
TABLE_WIDTH = 32  # blocks per sequence, at most


def build(source: str, out_dir: str):
    """The kernel compiled from `source` with the plugin's flags for the level the plugin would
    load here (OMNIINFER_CPU_ISA caps it); its paged-attention function."""
    from omniinfer_cpu.kernels import isa
    from omniinfer_cpu.kernels.build import SIGNATURES

    level, why = isa.choose(os.environ.get(isa.ENV_ISA))
    if level is None:
        sys.exit(f"error: no kernel level to build: {why}")
    lib = os.path.join(out_dir, f"k{abs(hash(os.path.abspath(source)))}.so")
    files = isa.sources(source) if os.path.isdir(source) else [source]
    error = isa.compile_and_link("gcc", [*isa.BASE_CFLAGS, *level.cflags, "-fopenmp"], files, lib)
    if error is not None:
        sys.exit(f"error: building {source} failed:\n{error[-2000:]}")
    fn = ctypes.CDLL(lib).omni_paged_attention
    fn.argtypes, fn.restype = SIGNATURES["omni_paged_attention"]
    return fn


def pack(logical: torch.Tensor) -> torch.Tensor:
    """[2, blocks, block_size, kv_heads, head] keys/values -> CPU_PAGED's layout (keys transposed
    inside each head's tile, in pairs of components for bfloat16)."""
    k, v = logical[0].permute(0, 2, 1, 3), logical[1].permute(0, 2, 1, 3)  # [blocks, kvh, bs, D]
    n = k.shape[0]
    if logical.dtype == torch.float32:
        kt = k.transpose(2, 3).contiguous().view(n, KVH, BS, D)
    else:
        kt = k.reshape(n, KVH, BS, D // 2, 2).permute(0, 1, 3, 2, 4).contiguous().view(n, KVH, BS, D)
    return torch.stack([kt, v.contiguous()])


def workload(kind: str, dtype: torch.dtype, num_blocks: int, num_caches: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logical = [torch.randn(2, num_blocks, BS, KVH, D, generator=g).to(dtype) for _ in range(num_caches)]
    if kind == "decode":
        ctx, qlen = [128 + (i * 7) % 128 for i in range(64)], [1] * 64
    else:
        ctx, qlen = [128] * 16, [128] * 16
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(ctx), TABLE_WIDTH, dtype=torch.int32)
    used = 0
    for s, n in enumerate(ctx):
        nb = -(-n // BS)
        tables[s, :nb] = perm[used:used + nb]
        used += nb
    slots = torch.tensor([int(tables[s, t // BS]) * BS + t % BS
                          for s in range(len(ctx)) for t in range(ctx[s] - qlen[s], ctx[s])])
    tokens = sum(qlen)
    return dict(logical=logical, caches=[pack(c) for c in logical], tables=tables, slots=slots,
                q=torch.randn(tokens, H * D, generator=g).to(dtype),
                k=torch.randn(tokens, KVH * D, generator=g).to(dtype),
                v=torch.randn(tokens, KVH * D, generator=g).to(dtype),
                qsl=torch.tensor([0, *torch.tensor(qlen).cumsum(0).tolist()], dtype=torch.int32),
                seq_lens=torch.tensor(ctx, dtype=torch.int32))


def call(fn, w: dict, layer: int) -> torch.Tensor:
    q, cache = w["q"], w["caches"][layer]
    out = torch.empty_like(q)
    result = fn(q.data_ptr(), q.stride(0), w["k"].data_ptr(), w["k"].stride(0), w["v"].data_ptr(),
                w["v"].stride(0), w["slots"].data_ptr(), q.shape[0], cache[0].data_ptr(),
                cache[1].data_ptr(), w["tables"].data_ptr(), w["tables"].stride(0), w["qsl"].data_ptr(),
                w["seq_lens"].data_ptr(), len(w["seq_lens"]), out.data_ptr(), out.stride(0), H, KVH, D,
                BS, 1 / math.sqrt(D), 0, 0 if q.dtype == torch.float32 else 1, torch.get_num_threads())
    if result != 0:
        raise RuntimeError(f"omni_paged_attention returned {result}")
    return out


def reference(w: dict) -> torch.Tensor:
    """torch attention over the logical cache with this step's keys and values written in."""
    cache = w["logical"][0].float().clone()
    flat = cache.view(2, -1, KVH, D)
    flat[0][w["slots"]] = w["k"].float().view(-1, KVH, D)
    flat[1][w["slots"]] = w["v"].float().view(-1, KVH, D)
    out = torch.empty(w["q"].shape[0], H, D)
    for s, n in enumerate(w["seq_lens"].tolist()):
        blocks = w["tables"][s, :-(-n // BS)].long()
        keys = cache[0][blocks].reshape(-1, KVH, D)[:n].repeat_interleave(H // KVH, 1)
        values = cache[1][blocks].reshape(-1, KVH, D)[:n].repeat_interleave(H // KVH, 1)
        a, b = int(w["qsl"][s]), int(w["qsl"][s + 1])
        scores = torch.einsum("thd,khd->htk", w["q"][a:b].float().view(-1, H, D), keys) / math.sqrt(D)
        positions = torch.arange(n - (b - a), n)[:, None]
        scores = scores.masked_fill(torch.arange(n)[None] > positions, float("-inf"))
        out[a:b] = torch.einsum("htk,khd->thd", scores.softmax(-1), values)
    return out.view(-1, H * D)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "plugins", "cpu",
                           "omniinfer_cpu", "kernels", "csrc")
    parser.add_argument("--source", action="append", help="kernel source (repeat for A/B; default: "
                        "the plugin's)")
    parser.add_argument("--cache", choices=["memory", "l3"], default="memory")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], action="append")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (the median counts)")
    parser.add_argument("--iters", type=int, default=20, help="layer-steps timed per round")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.rounds < 1 or args.iters < 1:
        parser.error(f"--rounds {args.rounds} / --iters {args.iters}: expected positive counts")
    sources = args.source or [os.path.normpath(default)]
    dtypes = [getattr(torch, d) for d in (args.dtype or ["float32", "bfloat16"])]
    results = []
    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        fns = [build(s, tmp) for s in sources]
        for dtype in dtypes:
            for kind in ("decode", "prefill"):
                if args.cache == "memory":  # four layers' 128 MiB (fp32) caches
                    w = workload(kind, dtype, 128 * 2**20 // (2 * BS * KVH * D * 4), LAYERS)
                else:
                    w = workload(kind, dtype, 1200, 1)
                expected = reference(w)
                tol = 1e-4 if dtype == torch.float32 else 3e-2
                for fn, source in zip(fns, sources):
                    error = (call(fn, w, 0).float() - expected).abs().max().item()
                    if not error < tol:
                        sys.exit(f"error: {source} ({kind}, {dtype}) is off the reference by {error}")
                times = {s: [] for s in sources}
                for _ in range(args.rounds):
                    for fn, source in zip(fns, sources):
                        t0 = time.perf_counter()
                        for i in range(args.iters):
                            call(fn, w, i % len(w["caches"]))
                        times[source].append((time.perf_counter() - t0) / args.iters * 1e6)
                row = {"dtype": str(dtype).removeprefix("torch."), "kind": kind, "cache": args.cache,
                       "us_per_layer_step": {s: statistics.median(t) for s, t in times.items()}}
                results.append(row)
                print(f"{row['dtype']:9s} {kind:8s} " + "  ".join(
                    f"{os.path.basename(s)}: {us:8.1f} us" for s, us in row["us_per_layer_step"].items()),
                    flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
