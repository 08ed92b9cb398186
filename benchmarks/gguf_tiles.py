"""GGUF Triton kernel tiles on a GPU: each launch configuration of kernels/triton/gguf_gemm.py's
product timed on Llama-3-8B's gate_up and down layers, beside torch's F.linear on the same
weights in the activation dtype, the weight dequantised by gguf_dequantize then multiplied by
F.linear, and gguf_linear (what the layers run: kernels/triton/dequant_linear.py). Every variant's output is checked against the reference (the
blocks dequantised by quantization/gguf_blocks.py, F.linear); a variant that disagrees is
marked, never ranked. The table says which configuration gguf_tiles should pick.

    python benchmarks/gguf_tiles.py [--type Q4_K ...] [--rows 1 2 4 8 512] [--budget-s 200]
                                    [--only REGEX] [--json out.json]

Decode rows (1-8) are measured in weight GB/s, prefill in TFLOP/s. --budget-s stops the sweep
(between variants) once spent, printing what ran. Needs a GPU (CUDA, ROCm or XPU torch), or
--tiny on the CPU with TRITON_INTERPRET=1 (a 72 x 512 layer: every path, numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import torch

LAYERS = [("llama-3-8b gate_up", 28672, 4096), ("llama-3-8b down", 4096, 14336)]
TOLERANCE = {torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6, torch.float32: 1e-5}


def gemm_tiles(k: int, block_m: int, block_n: int, warps: int, stages: int) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32, split_k=1, k_per_split=k,
                USE_DOT=True, num_warps=warps, num_stages=stages)


def variants(m: int, n: int, k: int, type_name: str, blocks, dtype):
    """(name, callable) of every configuration tried for `m` rows."""
    import triton

    from omniinfer.kernels.triton.dequant_linear import gguf_linear
    from omniinfer.kernels.triton.gguf_gemm import gguf_dequantize, gguf_matmul, gguf_tiles
    from omniinfer.kernels.triton.quant_gemm import split_k

    def dequantised(block_n, runs, warps):
        return lambda x: torch.nn.functional.linear(
            x, gguf_dequantize(blocks, type_name, k, x.dtype, block_n, runs, warps))

    out = [("gguf_linear (current)", lambda x: gguf_linear(x, blocks, type_name)),
           ("gguf_tiles (current)", lambda x: gguf_matmul(x, blocks, type_name))]
    if m <= 8:  # (H200, 2026-12-04: 512 programs lost to 2048 in every case, so only 2048 now)
        if m == 1:  # the byte decoder the one-row GEMVs replaced, for the A/B
            cfg = dict(gguf_tiles(1, n, k, dtype.itemsize, type_name, block_n=64, programs=2048,
                                  num_warps=4), ONE_ROW=0)
            cfg["split_k"], cfg["k_per_split"] = split_k(triton.cdiv(n, 64), k, 32, 2048)
            out.append(("gemv byte decoder n64 w4 p2048",
                        lambda x, c=cfg: gguf_matmul(x, blocks, type_name, tiles=c)))
        for block_n in (32, 64, 128, 256):  # (256: the sm_90 estimate's best for Q4_K / Q5_K)
            for warps in (2, 4):
                cfg = gguf_tiles(m, n, k, dtype.itemsize, type_name, block_n=block_n,
                                 programs=2048, num_warps=warps)
                out.append((f"gemv n{block_n} w{warps} p2048 split{cfg['split_k']}",
                            lambda x, c=cfg: gguf_matmul(x, blocks, type_name, tiles=c)))
        # the rows padded to 16 for tl.dot (tensor cores), split over K as the GEMV is
        for block_n in (64, 128):
            cfg = dict(gguf_tiles(m, n, k, dtype.itemsize, type_name, block_n=block_n,
                                  programs=2048, num_warps=4), BLOCK_M=16, USE_DOT=True)
            out.append((f"dot16 n{block_n} w4 p2048 split{cfg['split_k']}",
                        lambda x, c=cfg: gguf_matmul(x, blocks, type_name, tiles=c)))
        # where the dequantised weight overtakes the GEMV (gguf_linear's GGUF_FUSED_MAX_M)
        out.append(("dequant n32 r8 w4 + F.linear", dequantised(32, 8, 4)))
    else:  # the dequantised weight first: with a small --budget-s both kinds still run
        for block_n, runs, warps in ((64, 4, 4), (32, 8, 4), (128, 4, 8), (64, 8, 8)):
            out.append((f"dequant n{block_n} r{runs} w{warps} + F.linear",
                        dequantised(block_n, runs, warps)))
        for block_m in (64, 128):  # (32 rows: 2-3x slower than 128 on the H200)
            for block_n in (64, 128):
                cfg = gemm_tiles(k, block_m, block_n, 4, 3)
                out.append((f"gemm m{block_m} n{block_n} w4",
                            lambda x, c=cfg: gguf_matmul(x, blocks, type_name, tiles=c)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--type", action="append", dest="types")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 512])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--json")
    ap.add_argument("--tiny", action="store_true", help="a 72 x 512 layer (interpreted on the CPU)")
    ap.add_argument("--only", help="only the variants this regular expression finds (dense F.linear "
                                   "always runs)")
    args = ap.parse_args()
    import numpy as np
    import triton.testing

    from omniinfer.kernels.triton import interpret_requested
    from omniinfer.quantization.gguf_blocks import BY_NAME, dequantize
    from omniinfer.testing.kquant import random_blocks

    xpu = getattr(torch, "xpu", None)
    if torch.cuda.is_available():  # (ROCm's torch answers here too)
        device = "cuda"
    elif xpu is not None and xpu.is_available():
        device = "xpu"
    elif args.tiny and interpret_requested():
        device = "cpu"
    else:
        print("no GPU: this benchmark times compiled Triton kernels (--tiny with TRITON_INTERPRET=1 "
              "runs it interpreted on the CPU)", file=sys.stderr)
        return 2
    layers = [("tiny", 72, 512)] if args.tiny else LAYERS
    bench = _cpu_bench if device == "cpu" else triton.testing.do_bench
    dtype = getattr(torch, args.dtype)
    types = args.types or ["Q4_K", "Q6_K", "Q8_0"]
    start = time.monotonic()
    results, failed = [], False
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else device
    print(f"GGUF kernel tiles on {device} ({gpu}), "
          f"{args.dtype} activations; us per call, weight GB/s (decode) or TFLOP/s (prefill)")
    print(f"{'layer':<19} {'type':<5} {'rows':>4}  {'variant':<34} {'us':>9} {'GB/s':>6} {'TFLOP/s':>8} {'error':>8}")
    for layer, n, k in layers:
        for type_name in types:
            kind = BY_NAME[type_name]
            data = random_blocks(kind, n, k, np.random.default_rng(kind.code))
            blocks = torch.from_numpy(data).to(device)
            weight = dequantize(blocks, kind, k).to(dtype)
            for m in args.rows:
                x = torch.randn(m, k, device=device, dtype=dtype)
                want = torch.nn.functional.linear(x, weight).float()
                scale = want.abs().max().item() or 1.0
                runs = [("torch F.linear (dense)", lambda x, w=weight: torch.nn.functional.linear(x, w))]
                runs += [(name, fn) for name, fn in variants(m, n, k, type_name, blocks, dtype)
                         if args.only is None or re.search(args.only, name)]
                for name, fn in runs:
                    if time.monotonic() - start > args.budget_s:
                        print(f"(budget of {args.budget_s:.0f} s spent: the sweep stops here)")
                        return _finish(results, args.json, failed)
                    row = dict(layer=layer, type=type_name, rows=m, variant=name)
                    try:
                        err = (fn(x).float() - want).abs().max().item() / scale
                        us = bench(lambda f=fn, a=x: f(a), warmup=5, rep=30) * 1e3
                    except Exception as e:  # a configuration the compiler refuses: named, not ranked
                        row["failed"] = f"{type(e).__name__}: {str(e)[:120]}"
                        print(f"{layer:<19} {type_name:<5} {m:>4}  {name:<34} FAILED {row['failed']}")
                        results.append(row)
                        continue
                    ok = err <= TOLERANCE[dtype]
                    failed |= not ok
                    gbs = blocks.numel() / us / 1e3 if not name.startswith("torch") else \
                        weight.numel() * weight.element_size() / us / 1e3
                    tflops = 2 * m * n * k / us / 1e6
                    row.update(us=us, gbs=gbs, tflops=tflops, error=err, ok=ok)
                    results.append(row)
                    print(f"{layer:<19} {type_name:<5} {m:>4}  {name:<34} {us:>9.1f} {gbs:>6.0f} "
                          f"{tflops:>8.2f} {err:>8.1e}{'' if ok else ' WRONG'}", flush=True)
                best = min((r for r in results if r.get("ok") and r["layer"] == layer
                            and r["type"] == type_name and r["rows"] == m
                            and not r["variant"].startswith("torch")), key=lambda r: r["us"],
                           default=None)
                if best:
                    dense = next(r["us"] for r in results if r["variant"].startswith("torch")
                                 and (r["layer"], r["type"], r["rows"]) == (layer, type_name, m))
                    print(f"{layer:<19} {type_name:<5} {m:>4}  best: {best['variant']} "
                          f"{best['us']:.1f} us ({dense / best['us']:.2f}x dense F.linear)")
    return _finish(results, args.json, failed)


def _cpu_bench(fn, warmup: int, rep: int) -> float:
    """Milliseconds of one call, the median of 3 (interpreted: do_bench's events are the GPU's)."""
    del warmup, rep
    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[1] * 1e3


def _finish(results, path, failed) -> int:
    if path:
        with open(path, "w") as f:
            json.dump({"results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
