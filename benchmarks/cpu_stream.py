"""Batch-1 products on the CPU against the machine's read bandwidth: one row of x times a weight
larger than the caches (GGUF formats through ``omni_qlinear``, int8 activations, as decode runs
it, every GGUF kind repacked in groups of 8 rows; ``int8``, a float weight quantised per output
channel as ``quantization="int8"`` does, row by row; float32 / bfloat16 through the CPU linear method,
``omni_linear``), the weight's bytes over the call's time, next to
a torch sum over 256 MiB timed in the same round (the read bandwidth a streaming kernel can
reach). Each kernel is first checked against the reference (dequantise, then F.linear).

    python benchmarks/cpu_stream.py [--kind gguf:Q4_0 ...] [--level avx2 --level avx2_vnni]
        [--rows 32768] [--cols 4096] [--layers N] [--rounds 9] [--json out.json]

--layers N times a decode step's products instead: N layers of the medium model (Qwen2.5-0.5B
shape: qkv 1152 x 896, o 896 x 896, gate_up 9728 x 896, down 896 x 4864), each layer its own
copy of the weights, called one after another as the layers run them: short products, where
how fast a stream starts counts (kinds in blocks of 256 are skipped: 896 is not a multiple).

Levels (OMNIINFER_CPU_ISA names; default the one loaded) are timed in turns, round by round. To
compare with an older revision, run this script from a worktree of it
(``git worktree add /tmp/old REV``, then ``PYTHONPATH=/tmp/old/core:/tmp/old/plugins/cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_line  # noqa: E402

KINDS = ("gguf:Q4_0", "gguf:Q8_0", "gguf:Q4_1", "gguf:Q5_0", "gguf:Q5_1", "gguf:Q4_K", "gguf:Q5_K", "gguf:Q6_K",
         "gguf:IQ4_NL", "gguf:IQ4_XS", "gguf:Q2_K", "gguf:Q3_K", "int8", "bfloat16", "float32")
READ_BYTES = 1 << 28
MEDIUM_LAYER = ((1152, 896), (896, 896), (9728, 896), (896, 4864))


def piece_of(kind: str, weight: torch.Tensor):
    import gguf

    from omniinfer.quantization.base import QuantPiece
    from omniinfer.testing import kquant

    if kind == "int8":  # quantization="int8": per output channel, symmetric (omni_qlinear's rows)
        from omniinfer.quantization import int8

        return int8.quantize(weight)
    name = kind.split(":")[1]
    w = weight.numpy()
    data = kquant.QUANTIZERS[name](w) if name in kquant.QUANTIZERS else \
        gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])
    raw = torch.from_numpy(np.ascontiguousarray(data.view(np.uint8).reshape(weight.shape[0], -1)))
    return QuantPiece(kind, tuple(weight.shape), {"blocks": raw})


class FloatProduct:
    """A float weight through the CPU linear method, as a model's layer holds it."""

    def __init__(self, weight: torch.Tensor):
        from omniinfer_cpu.kernels import build
        from omniinfer_cpu.linear import CpuLinearMethod

        self.layer = torch.nn.Module()
        self.layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.layer.bias = None
        self.method = CpuLinearMethod(build.load())
        self.method.process_weights_after_loading(self.layer)
        self.dtype = weight.dtype
        self.nbytes = weight.numel() * weight.element_size()

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self.layer, x.to(self.dtype)).float()


def kernel_at(level: str, kind: str, piece):
    from omniinfer_cpu.kernels import build, isa
    from omniinfer_cpu.quant import CpuQuantKernel

    os.environ[isa.ENV_ISA] = level
    build.reset()
    if build.load() is None or build.load().level.name != level:
        sys.exit(f"error: --level {level}: {build.unavailable_reason() or build.selection()[1]}")
    if kind in ("float32", "bfloat16"):
        return FloatProduct(piece.to(getattr(torch, kind)))
    kernel = CpuQuantKernel(piece)
    kernel.nbytes = sum(t.numel() * t.element_size() for t in kernel.piece.tensors.values())
    return kernel


def main() -> None:
    from omniinfer.quantization.gguf_blocks import BY_NAME
    from omniinfer_cpu.kernels import build, isa
    from omniinfer_cpu.quant import ACT_ENV

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", action="append", choices=KINDS, help="repeatable (default: all)")
    parser.add_argument("--level", action="append", help="an ISA level to time (repeatable)")
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--cols", type=int, default=4096, help="a multiple of 256")
    parser.add_argument("--layers", type=int, default=0, help="time N medium-model layers' products instead")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.cols % 256 or args.cols <= 0 or args.rows <= 0:
        parser.error(f"--rows {args.rows} --cols {args.cols}: positive, cols a multiple of 256")
    if args.layers < 0:
        parser.error(f"--layers {args.layers}: a count of layers, 0 (one weight) or more")
    shapes = MEDIUM_LAYER if args.layers else ((args.rows, args.cols),)
    valid = [lv.name for lv in isa.runnable_levels()]
    for level in args.level or []:
        if level not in valid:
            parser.error(f"--level {level!r}: this CPU runs {', '.join(valid) or 'none'}")
    if build.load() is None:
        sys.exit(f"error: the CPU kernels are unavailable: {build.unavailable_reason()}")
    levels = args.level or [build.load().level.name]
    os.environ[ACT_ENV] = "int8"
    print(machine_line())
    what = f"{args.layers} medium layers" if args.layers else f"weight {args.rows} x {args.cols}"
    print(f"threads {torch.get_num_threads()}; {what}; medians of {args.rounds} rounds")
    gen = torch.Generator().manual_seed(0)
    src = torch.ones(READ_BYTES // 4)
    results = []
    for kind in args.kind or KINDS:
        from omniinfer.quantization.base import QuantPiece, dequantize_piece

        block = BY_NAME[kind[5:]].block if kind.startswith("gguf:") else 1
        if args.layers and 896 % block:
            print(f"  {kind:10s} skipped: in blocks of {block}, and the medium model's rows are 896 wide")
            continue
        pieces = []  # (piece, x) a shape, each checked against the reference at every level
        xs = {}
        for rows, cols in shapes:
            weight = torch.randn(rows, cols, generator=gen) * 0.05
            x = xs.setdefault(cols, torch.randn(1, cols, generator=gen))
            if kind in ("float32", "bfloat16"):
                piece, want = weight, F.linear(x.to(getattr(torch, kind)).float(),
                                               weight.to(getattr(torch, kind)).float())
            else:
                piece = piece_of(kind, weight)
                want = F.linear(x, dequantize_piece(piece))
            del weight
            for level in levels:
                got = kernel_at(level, kind, piece).apply(x)  # int8 x: within 1% of the output's scale
                err = float((got - want).abs().max() / want.abs().max())
                if err > 0.02:
                    sys.exit(f"error: {kind} at {level} is {err:.3f} (relative) from the reference")
            pieces.append((piece, x))

        def copy(piece):  # a layer's own bytes
            return piece.clone() if isinstance(piece, torch.Tensor) else QuantPiece(
                piece.kind, piece.shape, {k: t.clone() for k, t in piece.tensors.items()})

        # the calls in a decode step's order: layer by layer (the first layer on the pieces themselves)
        kernels = {level: [(kernel_at(level, kind, piece if layer == 0 else copy(piece)), x)
                           for layer in range(max(1, args.layers)) for piece, x in pieces] for level in levels}
        nbytes = sum(k.nbytes for k, _ in kernels[levels[0]])
        times = {level: [] for level in levels}
        reads = []
        for r in range(args.rounds):
            src.sum()
            t0 = time.perf_counter()
            src.sum()
            reads.append(READ_BYTES / (time.perf_counter() - t0) / 1e9)
            for level in levels[r % len(levels):] + levels[:r % len(levels)]:
                t0 = time.perf_counter()
                for kernel, x in kernels[level]:
                    kernel.apply(x)
                times[level].append(time.perf_counter() - t0)
        read = statistics.median(reads)
        for level in levels:
            seconds = statistics.median(times[level])
            row = {"kind": kind, "level": level, "mb": nbytes / 1e6, "us": seconds * 1e6,
                   "gbps": nbytes / seconds / 1e9, "read_gbps": read,
                   "read_fraction": statistics.median(nbytes / t / 1e9 / g for t, g in zip(times[level], reads))}
            results.append(row)
            print(f"  {kind:10s} {level:12s} {row['mb']:7.1f} MB {row['us']:9.1f} us  {row['gbps']:5.1f} GB/s  "
                  f"read {read:5.1f} GB/s  -> {row['read_fraction']:.0%} of the round's read")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
