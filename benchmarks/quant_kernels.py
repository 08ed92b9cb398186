"""Quantized-GEMM micro-benchmark: the Triton products the layers run (kernels/triton/
dequant_linear.py: the fused kernels of quant_gemm.py and gguf_gemm.py for a few rows, the
weight dequantised then torch's matmul for more; --path fused / dequant forces one) against
torch's F.linear on the same weights dequantized to the activation dtype, each output checked
against the torch reference (quantization/int_reference.py; for GGUF blocks the weight
dequantized by quantization/gguf_blocks.py, multiplied by F.linear).

    python benchmarks/quant_kernels.py [--platform cuda] [--dtype bfloat16] [--iters N]
                                       [--format NAME ...] [--rows M ...] [--json out.json]
                                       [--path auto|fused|dequant] [--include-interpreted]

Layers are Llama-3-8B's per-rank gate_up (28672 x 4096) and down (4096 x 14336) on
accelerators, at 1 and 8 rows (decode: weight bytes per second is the measure) and 512 rows
(prefill: TFLOP/s); a tiny layer on the CPU, where the kernels run only interpreted
(--include-interpreted sets TRITON_INTERPRET=1 for this process; slow: for dry runs).
Weights are random codes, scales and zeros (their values do not change the time); GGUF formats
are random blocks of the type (testing/kquant.random_blocks), Q4_K and Q6_K as a Q4_K_M file
holds them, Q8_0, and Q5_0 (a narrow model's fallback); FP8 as Qwen3-*-FP8 holds it (e4m3
codes, a float32 scale per 128 x 128 block, spread over the rows). Exit
status 1 when a kernel fails or disagrees with the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from functools import partial

import torch

GPU_LAYERS = [("llama-3-8b gate_up", 28672, 4096), ("llama-3-8b down", 4096, 14336)]
CPU_LAYERS = [("tiny", 72, 256)]
GPU_ROWS, CPU_ROWS = (1, 8, 512), (1, 17)
FORMATS = ("int4-g128", "int4-g128-zeros", "int4-g32-g_idx", "int8-w8a16", "int8-w8a8",
           "gguf-q4_k", "gguf-q6_k", "gguf-q8_0", "gguf-q5_0", "gguf-q4_0", "gguf-q5_k",
           "gguf-iq4_xs", "fp8-b128")
# outputs agree to the output dtype's rounding, relative to the largest output (two units)
TOLERANCE = {torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6, torch.float32: 1e-5}


@dataclass(frozen=True)
class GGUFWeight:
    """A GGUF-quantised weight as the layers hold it: the file's blocks [n, row bytes]."""

    blocks: torch.Tensor
    type_name: str
    k: int

    def dequantize(self) -> torch.Tensor:
        from omniinfer.quantization.gguf_blocks import BY_NAME, dequantize

        return dequantize(self.blocks, BY_NAME[self.type_name], self.k)


@dataclass(frozen=True)
class FP8Weight:
    """An FP8 checkpoint's weight as the layers hold it (quantization/fp8.py's piece): e4m3 codes
    [n, k] and float32 scales [n, ceil(k / scale_cols)]."""

    q: torch.Tensor
    scale: torch.Tensor
    scale_cols: int

    def dequantize(self) -> torch.Tensor:
        from omniinfer.quantization.base import QuantPiece
        from omniinfer.quantization.fp8 import _dequantize, fp8_kind

        n, k = self.q.shape
        kind = fp8_kind(None if self.scale_cols >= k else self.scale_cols)
        return _dequantize(QuantPiece(kind, (n, k), {"q": self.q, "scale": self.scale}))


def make_weight(fmt: str, n: int, k: int, dtype, device, gen):
    """A random weight of `fmt` in the kernels' layout."""
    from omniinfer.quantization.int_layouts import Int8Weight, PackedIntWeight

    if fmt.startswith("gguf"):
        import numpy as np

        from omniinfer.quantization.gguf_blocks import BY_NAME
        from omniinfer.testing.kquant import random_blocks

        name = fmt.removeprefix("gguf-").upper()
        seed = int(torch.randint(0, 2 ** 31, (1,), generator=gen))
        blocks = random_blocks(BY_NAME[name], n, k, np.random.default_rng(seed))
        return GGUFWeight(torch.from_numpy(blocks).to(device), name, k)
    if fmt.startswith("fp8"):
        codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.int32)
        codes = torch.where(codes & 0x7F == 0x7F, codes - 1, codes).to(torch.uint8)  # (no NaNs)
        scale = torch.rand(n, -(-k // 128), generator=gen) * 0.01 + 1e-3
        return FP8Weight(codes.to(device), scale.to(device), 128)
    if fmt.startswith("int8"):
        codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, generator=gen) * 0.01 + 1e-3
        return Int8Weight(codes.to(device), scale.to(device), None, fmt == "int8-w8a8")
    group = 32 if "g32" in fmt else 128
    groups = -(-k // group)
    words = torch.randint(-2 ** 31, 2 ** 31, (k // 8, n), generator=gen, dtype=torch.int64)
    scales = (torch.rand(groups, n, generator=gen) * 0.01 + 1e-3).to(dtype)
    zeros = (torch.randint(0, 16, (groups, n), generator=gen).to(dtype)
             if "zeros" in fmt else None)
    g_idx = (torch.randperm(k, generator=gen) // group).to(torch.int32) if "g_idx" in fmt else None
    return PackedIntWeight(words.to(torch.int32).to(device), scales.to(device),
                           None if zeros is None else zeros.to(device),
                           None if g_idx is None else g_idx.to(device), 4, group, k, n)


def kernel_call(weight, path: str = "auto"):
    """The product the layers run (`path` auto: dequant_linear's choice by rows), or always the
    fused kernel, or always the weight dequantised then torch's matmul (W8A8 has one path)."""
    from omniinfer.kernels.triton import dequant_linear as dl
    from omniinfer.quantization.int_layouts import Int8Weight

    bound = {"auto": {}, "fused": {"fused_max_m": 1 << 62}, "dequant": {"fused_max_m": -1}}[path]
    if isinstance(weight, GGUFWeight):
        return lambda x: dl.gguf_linear(x, weight.blocks, weight.type_name, **bound)
    if isinstance(weight, FP8Weight):
        return lambda x: dl.fp8_linear(x, weight.q, weight.scale, weight.scale_cols, **bound)
    if isinstance(weight, Int8Weight):
        return lambda x: dl.int8_linear(x, weight.weight, weight.weight_scale, weight.input_scale,
                                        weight.quantize_activations, **bound)
    return lambda x: dl.wn_linear(x, weight.qweight, weight.scales, weight.zeros, weight.g_idx,
                                  weight.bits, weight.group_size, **bound)


def reference(weight, x):
    from omniinfer.quantization.int_layouts import Int8Weight
    from omniinfer.quantization.int_reference import int8_linear_reference, wn_linear_reference

    if isinstance(weight, (GGUFWeight, FP8Weight)):  # the ReferenceKernel's product
        return torch.nn.functional.linear(x, weight.dequantize().to(x.dtype))
    return (int8_linear_reference if isinstance(weight, Int8Weight) else wn_linear_reference)(
        x, weight)


def weight_bytes(weight) -> int:
    return sum(t.numel() * t.element_size() for t in
               (getattr(weight, f) for f in ("qweight", "scales", "zeros", "g_idx", "weight",
                                             "weight_scale", "blocks", "q", "scale")
                if hasattr(weight, f)) if t is not None)


def timed(fn, x, synchronize, iters: int) -> float:
    """Seconds per call."""
    with torch.inference_mode():
        for _ in range(2):
            fn(x)
        synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(x)
        synchronize()
    return (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--format", action="append", default=[], choices=FORMATS)
    parser.add_argument("--rows", action="append", type=int, default=[])
    parser.add_argument("--path", default="auto", choices=["auto", "fused", "dequant"],
                        help="auto: the product the layers run; fused: always the fused kernel; "
                             "dequant: always the weight dequantised, then torch's matmul")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--include-interpreted", action="store_true")
    args = parser.parse_args(argv)

    from omniinfer.platforms.registry import get_registry

    platform = get_registry().select_platform(args.platform)
    on_cpu = platform.device_type == "cpu"
    if on_cpu and args.include_interpreted:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
    from omniinfer.benchmarks.perf import machine_line
    from omniinfer.kernels.triton import unavailable_reasons

    device = "cpu" if on_cpu else platform.device_type
    dtype = getattr(torch, args.dtype)
    layers = CPU_LAYERS if on_cpu else GPU_LAYERS
    rows = args.rows or (CPU_ROWS if on_cpu else GPU_ROWS)
    iters = args.iters or (1 if on_cpu else 20)
    refused = unavailable_reasons(device)
    gen = torch.Generator().manual_seed(0)
    results = []
    for label, n, k in layers:
        for fmt in args.format or FORMATS:
            weight = make_weight(fmt, n, k, dtype, device, gen)
            dense = weight.dequantize().to(dtype)  # the same weights in float, for F.linear
            for m in rows:
                x = (torch.randn(m, k, generator=gen) * 0.5).to(dtype).to(device)
                row = dict(layer=label, format=fmt, rows=m, n=n, k=k, dtype=args.dtype,
                           weight_mb=weight_bytes(weight) / 1e6)
                row["torch_us"] = timed(partial(torch.nn.functional.linear, weight=dense), x,
                                        platform.synchronize, iters) * 1e6
                if refused:
                    row["skipped"] = refused[0]
                    results.append(row)
                    continue
                try:
                    fn = kernel_call(weight, args.path)
                    out, ref = fn(x), reference(weight, x)
                    row["error"] = ((out.float() - ref.float()).abs().max()
                                    / ref.float().abs().max().clamp(min=1e-30)).item()
                    row["ok"] = row["error"] <= TOLERANCE[dtype]
                    row["triton_us"] = timed(fn, x, platform.synchronize, iters) * 1e6
                except Exception as e:  # one failure must not hide the other numbers
                    row["failed"] = f"{type(e).__name__}: {e}"[:300]
                results.append(row)

    print(machine_line())
    print(f"quantized GEMMs on {platform.name} ({device}), {args.dtype} activations, path "
          f"{args.path}; "
          "us per call, weight GB/s (decode) or TFLOP/s (prefill), max error relative to the "
          "largest output")
    print(f"{'layer':<20} {'format':<16} {'rows':>5} {'MB':>7} {'torch us':>9} {'triton us':>10} "
          f"{'x torch':>8} {'GB/s':>7} {'TFLOP/s':>8} {'error':>9}")
    for r in results:
        head = (f"{r['layer']:<20} {r['format']:<16} {r['rows']:>5} {r['weight_mb']:>7.1f} "
                f"{r['torch_us']:>9.1f}")
        if "skipped" in r or "failed" in r:
            print(f"{head}  {'skipped' if 'skipped' in r else 'FAILED'}: "
                  f"{r.get('skipped') or r.get('failed')}")
            continue
        t = r["triton_us"] * 1e-6
        print(f"{head} {r['triton_us']:>10.1f} {r['torch_us'] / r['triton_us']:>8.2f} "
              f"{r['weight_mb'] / 1e3 / t:>7.0f} {2 * r['rows'] * r['n'] * r['k'] / t / 1e12:>8.2f} "
              f"{r['error']:>9.1e}{'' if r['ok'] else '  OVER TOLERANCE'}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(platform=platform.name, results=results), f, indent=1)
    return 1 if any("failed" in r or r.get("ok") is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
