"""Tokens/s with and without speculative decoding on the CPU, with the acceptance rate.

By default: the shipped demo model as the target and its smaller sibling as the draft
(trained on the same text), plus the target as its own draft (an upper bound on
acceptance). Greedy, batch 1 and batch 4, prompts from the demo prompts.

    python benchmarks/spec_decode.py [--target DIR --draft DIR] [--k 2 4] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

DEMO = os.path.join(os.path.dirname(__file__), "..", "core", "omniinfer", "assets", "demo")
PROMPTS = ["Return the", "This module provides", "def ", "The default value is", "Raise ValueError if",
           "Create a new", "If the file", "A list of"]


def run(target: str, draft: str | None, k: int, batch: int, max_tokens: int, repeats: int) -> dict:
    from omniinfer import LLM, SamplingParams

    kwargs = dict(speculative_model=draft, num_speculative_tokens=k) if draft else {}
    llm = LLM(target, max_num_seqs=max(batch, 1), **kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = (PROMPTS * batch)[:batch]
    llm.generate(prompts, params, use_tqdm=False)  # warm up
    rates, outputs = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
        outputs = [o.outputs[0].token_ids for o in outs]
    stats = llm.llm_engine.stats()
    llm.llm_engine.shutdown()
    return {"tokens_per_s": statistics.median(rates), "acceptance_rate": stats.get("spec_acceptance_rate"),
            "outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=os.path.join(DEMO, "model"))
    parser.add_argument("--draft", default=os.path.join(DEMO, "draft"))
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for batch in args.batch:
        base = run(args.target, None, 0, batch, args.max_tokens, args.repeats)
        rows.append({"batch": batch, "draft": "-", "k": 0, **base, "speedup": 1.0})
        for name, draft in (("draft", args.draft), ("target (upper bound)", args.target)):
            for k in args.k:
                r = run(args.target, draft, k, batch, args.max_tokens, args.repeats)
                assert r["outputs"] == base["outputs"], "greedy output changed with speculation"
                rows.append({"batch": batch, "draft": name, "k": k, **r,
                             "speedup": r["tokens_per_s"] / base["tokens_per_s"]})
    from omniinfer.benchmarks.perf import machine_line

    print(machine_line())
    print(f"{'batch':>5} {'draft':<22} {'k':>2} {'tok/s':>8} {'accept':>7} {'speedup':>8}")
    for r in rows:
        accept = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        print(f"{r['batch']:>5} {r['draft']:<22} {r['k']:>2} {r['tokens_per_s']:>8.1f} {accept:>7} "
              f"{r['speedup']:>7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in rows], f, indent=2)


if __name__ == "__main__":
    main()
