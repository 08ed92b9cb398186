"""CPU quantised products of many rows: AMX's bfloat16 tiles (quant_amx.c) against the int8 path
(VNNI / AVX2 int8 dots) on the same weight, in one process, the two taking turns.

    python benchmarks/cpu_quant_tiles.py [--kinds Q4_K Q6_K int8 ...] [--shape 4864 1792]
                                         [--rows 8 16 32 512] [--repeats 5]

For each kind (a GGUF block type, its rows repacked in groups of 8, or `int8`: quantization="int8"
rows, a scale each) and row count: the median ms of `--repeats` rounds (each the mean of 3 calls,
after a warm-up) of the int8 path (OMNIINFER_CPU_AMX off) and of the tiles, their ratio, and each
output's largest error against its own reference relative to the largest output: the tiles
against F.linear of x and the dequantised weight both rounded to bfloat16, the int8 path against
float64 (its x rounding in int8 blocks of 32 is the error it shows). Below the tiles' row
threshold (report.AMX_ROWS / AMX_ROWS_I8) only the int8 path runs. The weights are random
blocks of each type (testing/kquant.random_blocks; their values do not change the time). Where
this CPU or library has no AMX, the tiles' column says why and only the int8 path is timed.
Exit status 1 when a tiles' output is further from its reference than bfloat16 rounding allows.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_line  # noqa: E402

KINDS = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q2_K", "Q3_K",
         "int8"]


def kernel(kind: str, n: int, k: int):
    import numpy as np
    import torch

    from omniinfer.quantization import int8
    from omniinfer.quantization.base import QuantPiece
    from omniinfer.quantization.gguf_blocks import BY_NAME
    from omniinfer.testing import kquant
    from omniinfer_cpu.quant import CpuQuantKernel

    if kind == "int8":
        return CpuQuantKernel(int8.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05))
    raw = torch.from_numpy(kquant.random_blocks(BY_NAME[kind], n, k, np.random.default_rng(0)))
    return CpuQuantKernel(QuantPiece(f"gguf:{kind}", (n, k), {"blocks": raw}))


def timed(fn, repeats: int) -> float:
    fn()
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        rounds.append((time.perf_counter() - t0) / 3)
    return statistics.median(rounds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    parser.add_argument("--shape", nargs=2, type=int, default=[4864, 1792], metavar=("N", "K"),
                        help="the weight's outputs and inputs (K a multiple of 256 for the K-quants)")
    parser.add_argument("--rows", nargs="+", type=int, default=[8, 16, 32, 512])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from omniinfer.quantization.gguf_blocks import BY_NAME

    ragged = [f"{kind} (blocks of {BY_NAME[kind].block})" for kind in args.kinds
              if kind != "int8" and args.shape[1] % BY_NAME[kind].block]
    if ragged:  # (the kernel would refuse each such weight with no word of why)
        parser.error(f"--shape {args.shape[0]} {args.shape[1]}: K={args.shape[1]} is not whole blocks of "
                     f"{', '.join(ragged)}")

    import torch
    import torch.nn.functional as F

    from omniinfer_cpu.kernels import build
    from omniinfer_cpu.quant import ACT_ENV
    from omniinfer_cpu.report import AMX_ROWS, AMX_ROWS_I8

    os.environ.setdefault(ACT_ENV, "int8")  # read when each kernel is made
    kernels = build.load()
    if kernels is None:
        print(f"CPU kernels unavailable: {build.unavailable_reason()}")
        return 1
    tiles = kernels.set_amx(True)
    print(machine_line())
    print(f"kernels: {kernels.level.name}; AMX tiles: {tiles}; weight {args.shape[0]} x {args.shape[1]}")
    n, k = args.shape
    failed = False
    for kind in args.kinds:
        kern = kernel(kind, n, k)
        w = kern.rows(torch.arange(n), torch.float32).double()
        for m in args.rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            kernels.set_amx(False)
            t_int8 = timed(partial(kern.apply, x), args.repeats)
            y = kern.apply(x).double()
            ref = F.linear(x.double(), w)
            line = (f"{kind:6s} {m:4d} rows  int8 path {t_int8 * 1e3:8.3f} ms "
                    f"(err {((y - ref).abs().max() / ref.abs().max()).item():.1e})")
            if tiles == "on" and m < (AMX_ROWS_I8 if kind == "int8" else AMX_ROWS):
                line += "  (below the tiles' threshold)"
            elif tiles == "on":
                kernels.set_amx(True)
                t_tiles = timed(partial(kern.apply, x), args.repeats)
                y = kern.apply(x).double()
                ref = F.linear(x.bfloat16().double(), w.bfloat16().double())
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                failed |= err > 1e-3
                line += f"  tiles {t_tiles * 1e3:8.3f} ms (err {err:.1e})  {t_int8 / t_tiles:5.2f}x"
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
