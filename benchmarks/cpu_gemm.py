"""Products on the CPU: the plugin's ``omni_gemm`` against oneDNN's packed weights.

Each linear shape of a model (`--shape small`: qkv 256 -> 512, o 256 -> 256, gate_up 256 ->
2 x 1024 with its SiLU-and-multiply, down 1024 -> 256, the LM head 256 -> 32000) at each row
count (`--rows`), in `--dtype` (bfloat16 by default), through the two paths the CPU linear
method has above two rows: oneDNN (``mkldnn._linear_pointwise`` on the weight reordered at load; for gate_up,
followed by the plugin's SiLU-and-multiply kernel) and ``omni_gemm`` (weights packed at load;
gate_up writing silu(gate) * up itself). Both are first checked against a float32 product;
then timed in interleaved rounds (one round: each path `--iters` times), medians printed in
microseconds a call and GFLOP/s.

    python benchmarks/cpu_gemm.py [--shape tiny|small|medium] [--dtype bfloat16|float32]
        [--rows 16 64 256] [--rounds 7] [--json out.json]

Needs the CPU kernels (omni_gemm is built at every ISA level; OMNIINFER_CPU_ISA=avx2 times the
AVX2 one on a CPU that has more).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from common import SHAPES, machine_line  # noqa: E402


def linear_shapes(shape: dict) -> list[tuple[str, int, int]]:
    """(name, in, out) of each product of a layer, and the LM head."""
    h, i, head = shape["hidden_size"], shape["intermediate_size"], shape["hidden_size"] // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * head
    return [("qkv_proj", h, qkv), ("o_proj", h, h), ("gate_up_proj", h, 2 * i), ("down_proj", i, h),
            ("lm_head", h, shape["vocab_size"])]


class Layer(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, silu_and_mul=None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.silu_and_mul = silu_and_mul


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="small", choices=["tiny", "small", "medium"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--iters", type=int, default=0, help="calls per round (default: ~20 ms of work)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.rounds < 1 or args.iters < 0 or min(args.rows) < 3:
        parser.error(f"--rounds {args.rounds} / --iters {args.iters} / --rows {args.rows}: expected "
                     "positive counts, and at least 3 rows (1-2 rows go to another kernel)")
    from omniinfer.models.layers.layer_ops import SiluAndMul
    from omniinfer_cpu.kernels import build
    from omniinfer_cpu.layer_ops import CpuLayerOps
    from omniinfer_cpu.linear import CpuLinearMethod, onednn_pack

    kernels = build.load()
    dtype = getattr(torch, args.dtype)
    code = 0 if dtype == torch.float32 else 1
    if kernels is None or not kernels.gemm_supported(code):
        sys.exit(f"omni_gemm is unavailable here for {args.dtype}: {build.unavailable_reason()}")
    act = SiluAndMul()
    act.ops = CpuLayerOps(kernels)
    method = CpuLinearMethod(kernels, pack=True)
    gen = torch.Generator().manual_seed(0)
    results = []
    print(machine_line())
    print(f"{args.shape} {args.dtype}, {torch.get_num_threads()} threads; us a call (GFLOP/s), median of "
          f"{args.rounds} rounds")
    baseline, why = onednn_pack(torch.zeros(64, 64, dtype=dtype))
    if baseline is None:
        print(f"oneDNN cannot pack {args.dtype} weights here ({why}): the baseline is torch's F.linear")
    print(f"{'product':>14} {'rows':>5} {'oneDNN' if baseline is not None else 'F.linear':>18} "
          f"{'omni_gemm':>18} {'speed-up':>9}")
    for name, num_in, num_out in linear_shapes(SHAPES[args.shape]):
        weight = (torch.randn(num_out, num_in, generator=gen) * num_in ** -0.5).to(dtype)
        gated = name == "gate_up_proj"
        layer = Layer(weight, act if gated else None)
        method.process_weights_after_loading(layer)
        packed, _ = onednn_pack(weight)

        def onednn(x, packed=packed, gated=gated, weight=weight):
            # oneDNN's packed weights; where it cannot pack (bfloat16 without AVX-512), F.linear
            y = (torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "") if packed is not None
                 else F.linear(x, weight))
            return act(y) if gated else y

        def omni(x, layer=layer, gated=gated):
            return method.apply_silu_and_mul(layer, x, None, act) if gated else method.apply(layer, x)

        for rows in args.rows:
            x = torch.randn(rows, num_in, generator=gen).to(dtype)
            want = F.linear(x.float(), weight.float())
            want = act.ops.silu_and_mul(want.to(dtype)).float() if gated else want
            tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
            for fn in (onednn, omni):
                torch.testing.assert_close(fn(x).float(), want, atol=tol, rtol=tol)
            flops = 2 * rows * num_in * num_out
            iters = args.iters or max(1, int(0.02 * 300e9 / flops))
            times = {"onednn": [], "omni_gemm": []}
            for _ in range(args.rounds):
                for key, fn in (("onednn", onednn), ("omni_gemm", omni)):
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        fn(x)
                    times[key].append((time.perf_counter() - t0) / iters * 1e6)
            us = {k: statistics.median(v) for k, v in times.items()}
            row = {"product": name, "rows": rows, "in": num_in, "out": num_out, "us": us,
                   "gflops": {k: flops / v / 1e3 for k, v in us.items()}}
            results.append(row)
            cells = [f"{us[k]:9.1f} ({row['gflops'][k]:4.0f})" for k in ("onednn", "omni_gemm")]
            print(f"{name:>14} {rows:>5} {cells[0]:>18} {cells[1]:>18} {us['onednn'] / us['omni_gemm']:8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
