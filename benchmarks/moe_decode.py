"""Mixture-of-experts batch-1 decode on the CPU: weight bytes read per token against the active
parameters' bytes, and ms per token, the compiled kernel (omni_moe) next to the torch reference.

    python benchmarks/moe_decode.py [--shape small|tiny] [--dtype float32|bfloat16]

The model is a random Qwen3-MoE-shaped checkpoint (transformers writes it). Every decode step's
routing is recorded from the MoE layers themselves: bytes read = the weights outside the experts
that a token reads (attention, routers, norms, the LM head, one embedding row) + the experts
routed to in that step, as the kernel reads them (each routed expert once, no other). The active
parameters' bytes are the same with `num_experts_per_tok` experts a layer, as model cards count
"activated" parameters. A kernel that made a dense pass over every expert would need the
all-expert bytes a token: printed as the read bandwidth that would take at the measured speed,
beside the read bandwidth this machine reaches (a sum over a large tensor).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_line, quiet, unwind_on_sigterm  # noqa: E402

SHAPES = {  # Qwen3-MoE-shaped: (hidden, layers, heads, kv heads, experts, top-k, expert intermediate)
    "tiny": (64, 2, 4, 2, 8, 2, 32),
    "small": (768, 4, 8, 4, 32, 4, 512),
}


def build(path: str, shape: str, dtype: str) -> str:
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    hidden, layers, heads, kv, experts, top_k, inter = SHAPES[shape]
    return build_tiny_checkpoint(path, "qwen3_moe", dtype=dtype, hidden_size=hidden, num_hidden_layers=layers,
                                 num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                                 num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                                 intermediate_size=2 * inter, norm_topk_prob=True, initializer_range=0.02)


class Recording:
    """A layer's MoE method, recording the distinct experts of each one-token call."""

    def __init__(self, inner, log: list):
        self.inner, self.log, self.name = inner, log, inner.name

    def apply(self, layer, x, topk_weights, topk_ids):
        if x.shape[0] == 1:
            self.log.append(int(topk_ids.unique().numel()))
        return self.inner.apply(layer, x, topk_weights, topk_ids)


def decode_ms(llm, prompt: list[int], output_len: int) -> float:
    """ms a decode step: a request of output_len tokens less one of a single token (the same
    prefill), over the output_len - 1 steps between them; after a warm-up request."""
    from omniinfer import SamplingParams

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - t0

    run(2)
    return 1e3 * (run(output_len) - run(1)) / (output_len - 1)


def measure(llm, input_len: int, output_len: int, repeats: int) -> dict:
    """ms per token and weight bytes read a token with each method, and the bytes they compare to."""
    from omniinfer.models.layers.moe import DEFAULT_MOE_METHOD, FusedMoE

    model = llm.llm_engine.executor.worker.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    element = layers[0].w13_weight.element_size()
    expert_bytes = (layers[0].w13_weight[0].numel() + layers[0].w2_weight[0].numel()) * element
    in_experts = {id(p) for m in layers for p in m.parameters()}
    embed = model.model.embed_tokens.weight
    outside = sum(p.numel() * p.element_size() for p in model.parameters()
                  if id(p) not in in_experts and p is not embed) + embed[0].numel() * embed.element_size()
    out = {"top_k": layers[0].top_k,
           "active_bytes": outside + len(layers) * layers[0].top_k * expert_bytes,
           "all_expert_bytes": outside + len(layers) * layers[0].num_experts * expert_bytes, "runs": {}}
    prompt = [3 + (i * 7) % 300 for i in range(input_len)]
    installed = {m: m.moe_method for m in layers}
    for label, pick in (("compiled", installed.get), ("torch reference", lambda m: DEFAULT_MOE_METHOD)):
        log: list[int] = []
        for m in layers:
            m.moe_method = Recording(pick(m), log)
        times = [decode_ms(llm, prompt, output_len) for _ in range(repeats)]
        experts_read = statistics.mean(log)  # distinct experts a layer reads a decode step
        out["runs"][label] = {"method": pick(layers[0]).name, "ms_per_token": statistics.median(times),
                              "bytes_read": outside + len(layers) * experts_read * expert_bytes}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.output_len < 2:
        parser.error(f"--output-len {args.output_len}: ms per output token needs at least 2 tokens")
    quiet()
    unwind_on_sigterm()
    from omniinfer import LLM
    from omniinfer.benchmarks.measure import copy_bandwidth

    read_gbps = copy_bandwidth(1 << 28)["read_gbps"]
    with tempfile.TemporaryDirectory() as tmp:
        path = build(os.path.join(tmp, "moe"), args.shape, args.dtype)
        with LLM(path, dtype=args.dtype, num_kv_blocks=64,
                 max_model_len=args.input_len + args.output_len + 8) as llm:
            r = measure(llm, args.input_len, args.output_len, args.repeats)
    hidden, num_layers, _, _, experts, top_k, inter = SHAPES[args.shape]
    active, everything = r["active_bytes"], r["all_expert_bytes"]
    print(f"MoE batch-1 decode, {args.dtype}, Qwen3-MoE-shaped '{args.shape}': hidden {hidden}, "
          f"{num_layers} layers, {experts} experts of {inter}, top-{top_k} ({machine_line()})")
    print(f"  active parameters' bytes a token: {active / 1e6:.2f} MB (all experts: {everything / 1e6:.2f} MB)")
    for label, run in r["runs"].items():
        ms, read = run["ms_per_token"], run["bytes_read"]
        print(f"  {label} ({run['method']}): {ms:.2f} ms/token; weight bytes read a token "
              f"{read / 1e6:.2f} MB = {read / active:.3f}x the active bytes; a dense pass over every "
              f"expert at this speed would need {everything / ms / 1e6:.1f} GB/s")
    print(f"  this machine reads {read_gbps:.1f} GB/s (a sum over 256 MB)")


if __name__ == "__main__":
    main()
