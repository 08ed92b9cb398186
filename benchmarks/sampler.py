"""What sampling costs a decode step: the engine's Sampler alone, on logits of a real vocabulary.

    python benchmarks/sampler.py [--vocab 151936] [--rows 1 32] [--scale 3 8] [--repeats 7]
                                 [--json out.json]

For each setting (greedy; temperature 1; top-p 0.95; top-k 40; llama.cpp's defaults, top-k 40,
top-p 0.95, min-p 0.05, temperature 0.8; a Qwen2.5 instruct checkpoint's generation_config, which
the engine takes as its defaults: top-k 20, top-p 0.8, temperature 0.7, repetition penalty
1.05), each logit scale and each row count: the median of
--repeats timed calls of the Sampler (after one warm-up), in ms per call, over the same
random logits (standard normal times the scale: the smaller the scale, the flatter a row and the
wider its top-p set, which the table gives: 4096 or fewer are found without sorting the row).

To compare with an older revision, run this script from a worktree of it
(``git worktree add /tmp/old REV``, then ``PYTHONPATH=/tmp/old/core``); the settings take turns,
round by round, so a noisy machine slows them alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import machine_line  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "top-p 0.95": dict(temperature=1.0, top_p=0.95),
    "top-k 40": dict(temperature=1.0, top_k=40),
    "llama.cpp defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    # what a Qwen2.5 instruct checkpoint's generation_config.json asks for (the engine's defaults then)
    "Qwen2.5 defaults": dict(temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
}


def metadata(params, num_rows: int):
    """A decode step's sampling metadata: `num_rows` sequences, one token each."""
    from omniinfer.sampling.metadata import SamplingMetadata, SeqState
    from omniinfer.step import NewSeq

    md = SamplingMetadata()
    for i in range(num_rows):
        seq = SeqState(NewSeq(i, f"r{i}", 0, params, [1, 2], []), {})
        seq.token_ids = [1, 2]
        md.seqs.append(seq)
        md.seq_ids.append(i)
        md.num_samples.append(1)
    return md


def top_p_set(logits: torch.Tensor, top_p: float) -> int:
    """The median row's top-p set size: the fewest best tokens whose mass reaches top_p."""
    probs = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True).values
    return int(statistics.median(((probs.cumsum(dim=-1) - probs) < top_p).sum(dim=-1).tolist()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936, help="default: Qwen2.5's")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--scale", type=float, nargs="+", default=[3.0, 8.0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), action="append",
                        help="(repeatable; default: all)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="append the result to this JSON file")
    args = parser.parse_args()
    for name in ("vocab", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: expected a positive number")
    if min(args.rows) < 1 or min(args.scale) <= 0:
        parser.error(f"--rows {args.rows} / --scale {args.scale}: expected positive numbers")
    from omniinfer.benchmarks.perf import append_json
    from omniinfer.sampling.params import SamplingParams
    from omniinfer.sampling.sampler import Sampler

    settings = args.setting or list(SETTINGS)
    g = torch.Generator().manual_seed(0)
    cases = []  # (setting, scale, rows, the call, its logits)
    for scale in args.scale:
        for rows in args.rows:
            logits = torch.randn(rows, args.vocab, generator=g) * scale
            for name in settings:
                sampler = Sampler(args.vocab, torch.Generator().manual_seed(1))
                md = metadata(SamplingParams(**SETTINGS[name]), rows)
                call = (lambda s, x, m: lambda: s(x, m))(sampler, logits, md)
                call()  # warm-up
                cases.append((name, scale, rows, call, logits))
    times = {i: [] for i in range(len(cases))}
    for _ in range(args.repeats):
        for i, (_, _, _, call, _) in enumerate(cases):
            start = time.perf_counter()
            call()
            times[i].append(time.perf_counter() - start)
    print(machine_line())
    print(f"the Sampler on a {args.vocab}-token vocabulary, median of {args.repeats} calls (ms per call)")
    rows_out = []
    for i, (name, scale, rows, _, _) in enumerate(cases):
        ms = 1e3 * statistics.median(times[i])
        rows_out.append({"setting": name, "scale": scale, "rows": rows, "ms": ms})
        print(f"  {name:<20} scale {scale:<4g} {rows:>3} rows: {ms:9.2f} ms")
    for scale in args.scale:
        logits = next(c[4] for c in cases if c[1] == scale)
        print(f"  scale {scale:g}: a row's top-p 0.95 set holds {top_p_set(logits, 0.95)} tokens (median row)")
    if args.json:
        append_json(args.json, {"vocab": args.vocab, "repeats": args.repeats, "results": rows_out})


if __name__ == "__main__":
    main()
