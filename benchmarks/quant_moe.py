"""Quantised experts on the CPU: one MoE layer's routed sum through QuantMoEMethod's per-expert loop
(each routed expert's two products through its CpuQuantKernel, torch between them) against the
CPU plugin's one call (`omni_qmoe` for one token, `omni_qmoe_tokens` for several), on the same
random weights (GGUF blocks from testing/kquant's quantisers), each output checked against the
loop's.

    python benchmarks/quant_moe.py [--experts 128] [--hidden 1024] [--intermediate 512] [--top-k 8]
                                   [--tokens 1 16 128] [--kinds Q4_K Q6_K] [--repeats 7]
                                   [--decode-steps N [--rounds 5]]

Prints the median ms of each over `--repeats` calls (after one warm-up) and their ratio. The
activations are int8 (the default; OMNIINFER_CPU_QUANT_ACTIVATIONS=float leaves chunks of tokens
to the loop, and the one call then times the same). Those calls route every repeat to the same
experts, whose weights then stay in the caches.

--decode-steps N times decode instead: N one-token calls of the one-call step, each routed to
its own random top-k (as a decode step's token is, so the routed experts' weights come from
memory when the layer is larger than the caches: e.g. `--experts 128 --hidden 2048
--intermediate 768`, Qwen3-30B-A3B's layer, 392 MB in Q4_K/Q6_K), in `--rounds` rounds; prints
the median ms a token and the routed weights' bytes over it (GB/s). The weights are then random
blocks of each kind (their values do not change the time; quantising 400 MB takes long); each
step's output is first checked against the loop's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_line  # noqa: E402


def layer(experts: int, hidden: int, inter: int, kinds: tuple[str, str], random_blocks: bool = False):
    import numpy as np
    import torch

    from omniinfer.quantization.base import QuantizedWeight, QuantLinearMethod, QuantPiece, Segment
    from omniinfer.quantization.experts import ExpertLinear, QuantExperts, QuantMoEMethod
    from omniinfer.quantization.gguf_blocks import BY_NAME
    from omniinfer.testing import kquant
    from omniinfer_cpu.quant import CpuQuantKernel

    gen, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)

    def expert(kind: str, rows: int, cols: int) -> ExpertLinear:
        w = (torch.randn(rows, cols, generator=gen) * 0.05).numpy() if not random_blocks else None
        if random_blocks:
            blocks = kquant.random_blocks(BY_NAME[kind], rows, cols, rng)
        elif kind in kquant.QUANTIZERS:
            blocks = kquant.QUANTIZERS[kind](w)
        else:
            import gguf

            blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
        raw = torch.from_numpy(np.ascontiguousarray(blocks.view(np.uint8).reshape(rows, -1)))
        piece = QuantPiece(f"gguf:{kind}", (rows, cols), {"blocks": raw})
        return ExpertLinear(QuantizedWeight(piece.shape, [Segment(0, piece)]))

    class Layer:
        num_experts = experts
        qexperts = QuantExperts([expert(kinds[0], 2 * inter, hidden) for _ in range(experts)],
                                [expert(kinds[1], hidden, inter) for _ in range(experts)])

    Layer.moe_method = QuantMoEMethod(QuantLinearMethod("cpu", [CpuQuantKernel]))
    Layer.moe_method.process_weights_after_loading(Layer)
    return Layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--kinds", nargs=2, default=["Q4_K", "Q6_K"], metavar=("GATE_UP", "DOWN"))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--decode-steps", type=int, default=0,
                        help="time this many one-token calls, each routed to its own experts")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of --decode-steps")
    args = parser.parse_args()
    if not 1 <= args.top_k <= args.experts:
        parser.error(f"--top-k {args.top_k}: expected 1..{args.experts} (--experts)")
    if args.decode_steps < 0 or args.rounds < 1:
        parser.error(f"--decode-steps {args.decode_steps}, --rounds {args.rounds}: expected >= 0 and >= 1")
    import torch

    moe = layer(args.experts, args.hidden, args.intermediate, tuple(args.kinds), random_blocks=args.decode_steps > 0)
    method, step = moe.moe_method, moe.moe_method.step
    if step is None:
        sys.exit("the CPU kernels give these experts no one-call step (see the start log)")
    print(f"{args.experts} experts, {args.hidden} wide, {args.intermediate} each, top {args.top_k}, "
          f"{args.kinds[0]} gate/up, {args.kinds[1]} down ({machine_line()})")
    if args.decode_steps:
        decode(moe, args)
        return
    gen = torch.Generator().manual_seed(1)
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden, generator=gen)
        ids = torch.stack([torch.randperm(args.experts, generator=gen)[:args.top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, args.top_k, generator=gen)
        times, outs = {}, {}
        for label, s in (("loop", None), ("one call", step)):
            method.step = s
            outs[label] = method.apply(moe, x, weights, ids)
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                method.apply(moe, x, weights, ids)
                runs.append(time.perf_counter() - t0)
            times[label] = statistics.median(runs) * 1e3
        method.step = step
        torch.testing.assert_close(outs["one call"], outs["loop"], rtol=1e-5, atol=1e-4)
        print(f"  {tokens:>4} tokens: loop {times['loop']:8.2f} ms, one call {times['one call']:8.2f} ms, "
              f"{times['loop'] / times['one call']:.2f}x")


def decode(moe, args) -> None:
    """--decode-steps: one-token calls, each to its own random experts (a decode step's token)."""
    import torch

    from omniinfer.quantization.gguf_blocks import BY_NAME

    method, step = moe.moe_method, moe.moe_method.step
    gen = torch.Generator().manual_seed(2)
    steps = [(torch.randn(1, args.hidden, generator=gen),
              torch.randperm(args.experts, generator=gen)[:args.top_k].unsqueeze(0),
              torch.rand(1, args.top_k, generator=gen)) for _ in range(args.decode_steps)]
    for x, ids, weights in steps[:3]:  # (checked once, outside the timing: the loop is slow)
        method.step = None
        want = method.apply(moe, x, weights, ids)
        method.step = step
        # (random blocks give outputs in the hundreds: float32 sums in another order differ there)
        torch.testing.assert_close(method.apply(moe, x, weights, ids), want, rtol=1e-4,
                                   atol=1e-5 * float(want.abs().max()))
    routed = args.top_k * (BY_NAME[args.kinds[0]].row_bytes(args.hidden) * 2 * args.intermediate
                           + BY_NAME[args.kinds[1]].row_bytes(args.intermediate) * args.hidden)
    per_token = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for x, ids, weights in steps:
            method.apply(moe, x, weights, ids)
        per_token.append((time.perf_counter() - t0) / len(steps))
    ms = statistics.median(per_token) * 1e3
    print(f"  decode: {len(steps)} tokens x {args.rounds} rounds, each routed anew: {ms:.3f} ms/token "
          f"(rounds {min(per_token) * 1e3:.3f}-{max(per_token) * 1e3:.3f}), routed weights "
          f"{routed / 2**20:.1f} MiB a token, {routed / (ms / 1e3) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
