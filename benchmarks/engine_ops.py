"""Where an engine step goes: each operation timed inside a real offline run.

Runs the throughput workload of a shape (`--shape small`: 64 prompts x (128 in, 128 out),
greedy, EOS ignored; `--num-prompts`, `--input-len` and `--output-len` change it, e.g.
`--shape medium --num-prompts 1` for the latency benchmark's batch-1 decode) on the engine the
`LLM` class builds, with a timer around each of:

* the model's pieces: every linear layer by kind (qkv_proj, o_proj, gate_up_proj with its
  SiLU-and-multiply, down_proj), the LM head (in an all-greedy step, which takes its tokens from
  the LM head, with the argmax), attention, and the layer ops (RMS norm, rotary;
  a silu_and_mul line where the activation runs apart from the product, inside gate_up_proj's
  time); "forward, the rest" is the model's forward minus those (Python, embedding, views).
  Where the platform runs the decoder layers as one stack (the CPU plugin's
  `omni_decoder_layers`), their pieces are not seen one by one: a "decoder stack" line has them
  all (`OMNIINFER_CPU_DECODER_STACK=0` shows the pieces, run layer by layer);
* the engine's: scheduling, input building (`prepare_model_input`, and the later steps'
  inputs of a multi-step run), sampling (its greedy argmax apart; the argmax line counts the
  calls inside the LM head too), output processing; "step, the rest" is the engine step minus
  everything timed.

Steps are split into prefill (any prompt token in the batch) and decode; figures are per
decode step (a multi-step schedule counts as its K steps), the median over `--repeats` runs
of the per-run totals. The timers add a few microseconds per call (a Python wrapper), so the
sum is a little above an untimed run.

    python benchmarks/engine_ops.py [--shape small] [--dtype bfloat16] [--repeats 3]
        [--num-prompts N] [--input-len I] [--output-len O] [--num-scheduler-steps K]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import (  # noqa: E402
    DEFAULT_WORKLOADS,
    SHAPES,
    build_random_checkpoint,
    machine_line,
    quiet,
    unwind_on_sigterm,
)

# the throughput benchmark's workloads (N, input, output), and a seconds-long one for CI
WORKLOADS = {**DEFAULT_WORKLOADS, "tiny": (8, 16, 8)}
LINEAR_KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class Timers:
    """Seconds and calls per (phase, name) for the current run."""

    def __init__(self):
        self.phase = "decode"
        self.seconds = collections.Counter()
        self.calls = collections.Counter()
        self.steps = collections.Counter()  # decode steps (K per multi-step schedule), prefill steps
        self.open: list[str] = []  # the timed calls in progress, outermost first

    def wrap(self, owner, attr: str, name: str) -> None:
        """Replace owner.attr (an instance's method or a module's forward) by a timed call."""
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            self.open.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.open.pop()
                elapsed = time.perf_counter() - t0
                self.seconds[(self.phase, name)] += elapsed
                self.calls[(self.phase, name)] += 1
                if self.open:  # also under "name/caller", for differences of nested spans
                    self.seconds[(self.phase, f"{name}/{self.open[-1]}")] += elapsed

        setattr(owner, attr, timed)


def instrument(llm, timers: Timers) -> None:
    engine = llm.llm_engine
    worker = engine.executor.worker
    runner = worker.model_runner
    model = runner.model
    layer_ops = None
    for name, module in model.named_modules():
        kind = name.rsplit(".", 1)[-1]
        if kind in LINEAR_KINDS:
            timers.wrap(module, "forward", kind)
        elif kind == "attn" and hasattr(module, "impl"):
            timers.wrap(module, "forward", "attention")
        if layer_ops is None and hasattr(module, "ops") and module.ops is not None:
            layer_ops = module.ops
    if layer_ops is not None:  # one object shared by every layer: wrap its methods once
        for op in ("rms_norm", "rotary", "silu_and_mul"):
            timers.wrap(layer_ops, op, op)
    timers.wrap(model, "forward", "forward")
    if getattr(model, "decoder_stack", None) is not None:
        timers.wrap(model, "decoder_stack", "decoder stack")
    timers.wrap(model, "compute_logits", "lm_head")
    if hasattr(model, "compute_greedy_tokens"):
        timers.wrap(model, "compute_greedy_tokens", "lm_head")
    timers.wrap(runner, "prepare_model_input", "input building")
    timers.wrap(runner, "decode_step_inputs", "later steps' inputs")
    timers.wrap(runner, "sample", "sampling")
    if hasattr(runner, "sample_tokens"):  # the output of a step whose tokens the LM head gave
        timers.wrap(runner, "sample_tokens", "sampling")
    timers.wrap(runner.sampler, "argmax_rows", "argmax")
    timers.wrap(engine.scheduler, "update_from_output", "output processing")
    timers.wrap(engine.output_processor, "process", "output processing")
    timers.wrap(engine.output_processor, "outputs", "output processing")

    schedule = engine.scheduler.schedule

    def classify():  # the phase is known once the scheduler has chosen the batch
        t0 = time.perf_counter()
        sched = schedule()
        decode = sched.seq_ids and sum(sched.num_scheduled_tokens) == len(sched.seq_ids)
        timers.phase = "decode" if decode else "prefill"
        timers.steps[timers.phase] += sched.num_steps if decode else 1
        timers.seconds[(timers.phase, "scheduling")] += time.perf_counter() - t0
        timers.calls[(timers.phase, "scheduling")] += 1
        return sched

    engine.scheduler.schedule = classify
    timers.wrap(engine, "step", "step")


INNER = ("decoder stack", "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "attention", "rms_norm",
         "rotary")
ENGINE = ("forward", "lm_head", "input building", "later steps' inputs", "sampling",
          "scheduling", "output processing")


def breakdown(timers: Timers, phase: str) -> dict[str, tuple[float, float]]:
    """name -> (ms per step, calls per step) for one phase of one run."""
    steps = timers.steps[phase]
    if not steps:
        return {}
    s = {name: timers.seconds[(phase, name)] for (p, name) in timers.seconds if p == phase}
    c = {name: timers.calls[(phase, name)] for (p, name) in timers.calls if p == phase}
    s["forward, the rest"] = s.get("forward", 0.0) - sum(s.get(n, 0.0) for n in INNER)
    s["sampling, the rest"] = s.get("sampling", 0.0) - s.get("argmax/sampling", 0.0)
    s["step, the rest"] = s.get("step", 0.0) - sum(s.get(n, 0.0) for n in ENGINE)
    return {name: (1e3 * v / steps, c.get(name, 0) / steps) for name, v in s.items()}


ORDER = ("decoder stack", *LINEAR_KINDS, "lm_head", "attention", "rms_norm", "rotary", "silu_and_mul",
         "forward, the rest", "forward", "argmax", "sampling, the rest", "sampling", "input building",
         "later steps' inputs", "scheduling", "output processing", "step, the rest", "step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="small", choices=sorted(WORKLOADS))
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, help="default: the shape's workload")
    parser.add_argument("--input-len", type=int, help="default: the shape's workload")
    parser.add_argument("--output-len", type=int, help="default: the shape's workload")
    parser.add_argument("--num-scheduler-steps", type=int, default=None,
                        help="decode steps per schedule (default: the LLM class's, 8)")
    parser.add_argument("--model", help="an existing checkpoint directory (default: built at random)")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: expected a positive number")
    for flag in ("num_scheduler_steps", "num_prompts", "input_len", "output_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} {value}: expected a positive number")
    quiet()
    from omniinfer import LLM, SamplingParams
    from omniinfer.benchmarks.perf import make_prompts

    num_prompts, input_len, output_len = (given or default for given, default in zip(
        (args.num_prompts, args.input_len, args.output_len), WORKLOADS[args.shape]))
    unwind_on_sigterm()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_random_checkpoint(os.path.join(tmp, "m"), args.shape, args.dtype)
        extra = {} if args.num_scheduler_steps is None else {"num_scheduler_steps": args.num_scheduler_steps}
        llm = LLM(path, dtype=args.dtype, max_num_seqs=num_prompts,
                  max_model_len=max(2048, input_len + output_len), **extra)
        prompts = make_prompts(num_prompts, input_len, SHAPES[args.shape]["vocab_size"])
        requests = [{"prompt_token_ids": p} for p in prompts]
        llm.generate(requests[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        timers = Timers()
        instrument(llm, timers)
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        runs = []
        for _ in range(args.repeats):
            timers.seconds.clear(), timers.calls.clear(), timers.steps.clear()
            t0 = time.perf_counter()
            llm.generate(requests, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            runs.append({"seconds": wall, "steps": dict(timers.steps),
                         **{phase: breakdown(timers, phase) for phase in ("prefill", "decode")}})
        llm.llm_engine.shutdown()
    k = llm.llm_engine.config.scheduler.num_scheduler_steps
    print(machine_line())
    print(f"{args.shape} {args.dtype}, {num_prompts} x ({input_len} in, {output_len} out), "
          f"{k} decode step(s) per schedule; run {statistics.median(r['seconds'] for r in runs):.3f} s "
          f"(median of {args.repeats})")
    result = {"shape": args.shape, "dtype": args.dtype, "num_prompts": num_prompts, "input_len": input_len,
              "output_len": output_len, "num_scheduler_steps": k, "runs": runs}
    for phase in ("prefill", "decode"):
        names = [n for n in ORDER if n in runs[0][phase]]
        print(f"\n{phase}: {runs[0]['steps'].get(phase, 0)} steps a run")
        print(f"{'':24} {'ms/step':>8} {'calls/step':>11} {'us/call':>8}")
        for name in names:
            ms = statistics.median(r[phase][name][0] for r in runs)
            calls = runs[0][phase][name][1]
            if calls:
                print(f"{name:24} {ms:8.3f} {calls:11.1f} {1e3 * ms / calls:8.1f}")
            else:  # a difference of timed spans
                print(f"{name:24} {ms:8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
