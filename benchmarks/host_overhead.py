"""Host overhead per engine step: scheduling + input building + sampling + detokenisation.

The model is swapped for a trivial one of the same vocabulary (its forward costs nearly
nothing: a view of fixed random logits), so what is timed is everything around the model,
for requests added as `LLM.generate` adds them (outputs only when finished). Greedy
sampling still reads every logit once ([seqs, 32000] float32), split across the cores. "cpu
ms" is the engine thread's CPU time (less sensitive to a busy machine than the wall-clock
median; it leaves out the other cores' share of the argmax).

    python benchmarks/host_overhead.py [--seqs 64 256 1024] [--steps 50] [--json out.json]
        [--num-scheduler-steps K]

The engine runs as the LLM class builds it: 8 decode steps per engine step (multi-step
decoding; `--num-scheduler-steps K` to change it, 1 for one schedule per token). The figures
are per decode step (an engine step's time / K), over `--steps` decode steps in all (so the
sequences grow as long whatever K).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import build_random_checkpoint, machine_line, unwind_on_sigterm  # noqa: E402


class TrivialModel(torch.nn.Module):
    """Same interface as the real model; logits are a fixed random table (greedy picks vary)."""

    def __init__(self, real: torch.nn.Module, vocab: int):
        super().__init__()
        self.num_local_layers = real.num_local_layers
        self.is_first_stage = self.is_last_stage = True
        self.vocab = vocab
        self.table = torch.randn(4096, vocab)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, intermediate_tensors=None):
        return input_ids  # "hidden states": one row per token

    def compute_logits(self, hidden):
        return self.table[: hidden.shape[0]]  # a view: producing logits costs nothing


def run(num_seqs: int, steps: int, model_dir: str, scheduler_steps: int = 1) -> dict:
    from omniinfer import LLM, SamplingParams

    k = scheduler_steps
    llm = LLM(model_dir, max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs),
              num_kv_blocks=num_seqs * 8 + 64, block_size=16, max_model_len=512,
              num_scheduler_steps=k)
    engine = llm.llm_engine
    runner = engine.executor.worker.model_runner
    runner.model = TrivialModel(runner.model, engine.config.model.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=steps + k + 10, ignore_eos=True)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", {"prompt_token_ids": [1 + i % 50] * 8}, params, stream=False)
    engine.step()  # all prefills
    while engine.stats()["num_waiting"]:
        engine.step()
    times, cpu = [], []
    for _ in range(-(-steps // k)):
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        times.append((time.perf_counter() - t0) / k)
        cpu.append((time.thread_time() - c0) / k)
    engine.abort_request([f"r{i}" for i in range(num_seqs)])
    median = statistics.median(times)
    return {"num_seqs": num_seqs, "num_scheduler_steps": k, "median_ms_per_step": median * 1e3,
            "us_per_seq": median * 1e6 / num_seqs, "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3,
            "median_cpu_ms_per_step": statistics.median(cpu) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json")
    parser.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="decode steps per engine step (multi-step decoding; default: the "
                             "LLM class's, 8)")
    args = parser.parse_args()
    if args.num_scheduler_steps is None:
        from omniinfer.entrypoints.llm import OFFLINE_SCHEDULER_STEPS

        args.num_scheduler_steps = OFFLINE_SCHEDULER_STEPS
    if args.num_scheduler_steps < 1:
        parser.error(f"--num-scheduler-steps {args.num_scheduler_steps}: expected a positive number")
    unwind_on_sigterm()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_checkpoint(os.path.join(tmp, "m"), "trivial")
        rows = [run(n, args.steps, model_dir, args.num_scheduler_steps) for n in args.seqs]
    print(machine_line())
    if args.num_scheduler_steps > 1:
        print(f"{args.num_scheduler_steps} decode steps per engine step; figures per decode step")
    print(f"{'running seqs':>12} {'ms/step (median)':>17} {'us/seq':>8} {'p90 ms':>8} {'cpu ms':>8}")
    for r in rows:
        print(f"{r['num_seqs']:>12} {r['median_ms_per_step']:>17.2f} {r['us_per_seq']:>8.1f} "
              f"{r['p90_ms']:>8.2f} {r['median_cpu_ms_per_step']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
