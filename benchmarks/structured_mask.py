"""What grammar masking costs a decode step: structured outputs at batch 16 on the demo model.

    python benchmarks/structured_mask.py [--batch 16] [--output-len 96] [--repeats 3]
                                         [--num-scheduler-steps 1] [--json out.json]

Two measurements, both on the platform the engine picks (the CPU here):

* end to end: the same batch decoded with and without a JSON schema (sampling at temperature
  1 both ways, so both go through the full sampler; the schema's one string of 1,000+ characters keeps every
  sequence decoding to --output-len), seconds per decode step, the best of --repeats runs;
  the overhead is (constrained - plain) / plain.
* on the critical path: the grammar work the sampler itself waits for per step (the
  prefetched mask's wait, the -inf fill, the matchers taking the drawn tokens), timed inside
  the step, as a share of the plain step.

The mask of the next step is filled on a helper thread while the model runs
(omniinfer/structured/state.py: MaskPrefetch), so the critical-path figure is the one that
the design is judged by; the end-to-end one also counts the helper thread's competition for
the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 1000}},
          "required": ["text"]}  # (a string no sequence finishes within --output-len)


def _engine(args):
    from omniinfer import LLM
    from omniinfer.entrypoints.cli_generate import DEMO_MODEL

    return LLM(args.model or DEMO_MODEL, num_kv_blocks=512, block_size=16,
               max_num_seqs=args.batch, num_scheduler_steps=args.num_scheduler_steps)


def _params(args, constrained: bool):
    from omniinfer import SamplingParams

    return [SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len, ignore_eos=True,
                           structured_outputs={"json": SCHEMA} if constrained else None)
            for i in range(args.batch)]


def _step_seconds(llm, args) -> tuple[float, float]:
    """Seconds per decode step over the batch, plain and constrained: runs alternate (the
    machine's load drifts), the best of --repeats each."""
    prompts = [f"Write item {i}:" for i in range(args.batch)]
    best = {False: float("inf"), True: float("inf")}
    for constrained in (False, True):  # warm-up (and the compile cache)
        llm.generate(prompts, _params(args, constrained), use_tqdm=False)
    for _ in range(args.repeats):
        for constrained in (False, True):
            start = time.perf_counter()
            outs = llm.generate(prompts, _params(args, constrained), use_tqdm=False)
            elapsed = time.perf_counter() - start
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            assert min(lengths) == max(lengths) == args.output_len, "a sequence ended early"
            best[constrained] = min(best[constrained], elapsed / args.output_len)
    return best[False], best[True]


def _critical_path(llm, args) -> float:
    """Seconds per step that the sampler spends on grammar work (timed around its calls)."""
    import omniinfer.sampling.sampler as sampler_module

    spent = [0.0]
    originals = {name: getattr(sampler_module, name) for name in ("mask_rows", "after_sampling")}

    def timed(fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - start
        return wrapper

    for name, fn in originals.items():
        setattr(sampler_module, name, timed(fn))
    try:
        spent[0] = 0.0
        steps = _count_steps(llm, args)
        return spent[0] / steps
    finally:
        for name, fn in originals.items():
            setattr(sampler_module, name, fn)


def _count_steps(llm, args) -> int:
    prompts = [f"Write item {i}:" for i in range(args.batch)]
    outs = llm.generate(prompts, _params(args, True), use_tqdm=False)
    return max(len(o.outputs[0].token_ids) for o in outs)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-scheduler-steps", type=int, default=1)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    from omniinfer.platforms.host import cpu_info

    llm = _engine(args)
    try:
        plain, constrained = _step_seconds(llm, args)
        critical = _critical_path(llm, args)
    finally:
        llm.shutdown()
    info = cpu_info()
    result = {"cpu": f"{info['model']}, {info['usable_cpus']} usable cores",
              "threads": os.environ.get("OMP_NUM_THREADS"),
              "batch": args.batch, "output_len": args.output_len,
              "plain_step_ms": plain * 1e3, "constrained_step_ms": constrained * 1e3,
              "end_to_end_overhead_pct": 100 * (constrained - plain) / plain,
              "critical_path_ms": critical * 1e3, "critical_path_pct": 100 * critical / plain}
    print(f"grammar masking at batch {args.batch} ({result['cpu']}, "
          f"OMP_NUM_THREADS={result['threads']}):")
    print(f"  decode step, plain        {result['plain_step_ms']:8.3f} ms")
    print(f"  decode step, JSON schema  {result['constrained_step_ms']:8.3f} ms "
          f"({result['end_to_end_overhead_pct']:+.1f}% end to end)")
    print(f"  grammar work the step waits for {result['critical_path_ms']:.3f} ms = "
          f"{result['critical_path_pct']:.1f}% of a decode step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
