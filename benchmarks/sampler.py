"""What sampling costs a decode step: the engine's Sampler alone, on logits of a real vocabulary.

    python benchmarks/sampler.py [--vocab 151936] [--rows 1 32] [--scale 3 8] [--repeats 7]
                                 [--platform cuda] [--json out.json]
    python benchmarks/sampler.py --prompt-logprobs 2048 [--top 1] [--vocab 151936] [--platform cuda]

For each setting (greedy; temperature 1; top-p 0.95; top-k 40; llama.cpp's defaults, top-k 40,
top-p 0.95, min-p 0.05, temperature 0.8; a Qwen2.5 instruct checkpoint's generation_config, which
the engine takes as its defaults: top-k 20, top-p 0.8, temperature 0.7, repetition penalty
1.05), each logit scale and each row count: the median of
--repeats timed calls of the Sampler (after one warm-up), in ms per call, over the same
random logits (standard normal times the scale: the smaller the scale, the flatter a row and the
wider its top-p set, which the table gives: 4096 or fewer are found without sorting the row).

With --prompt-logprobs ROWS, instead: what one prompt chunk of ROWS tokens costs when its
request asks for prompt_logprobs=--top (lm-evaluation-harness' loglikelihood asks for 1): the
process's peak resident memory growth in the first call, beyond the chunk's logits (held before
it), and the median time of --repeats more calls. Run it in a process of its own (the peak is the
process's). On a GPU platform (--platform; scripts/gpu_check.sh runs both modes) the logits are on
its device, each call ends with the results on the host, and the peak is the device allocator's.

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
    # the openai SDK's logprobs=True, top_logprobs=5: each token's log-prob, rank and 5 best
    "greedy, logprobs 5": dict(temperature=0.0, logprobs=5),
    "temperature 1, logprobs 1": dict(temperature=1.0, logprobs=1),
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


def peak_bytes(device: torch.device) -> int:
    """The peak memory so far: the process's resident set on the CPU, the allocator's elsewhere."""
    if device.type == "cpu":
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return torch.get_device_module(device.type).max_memory_allocated()


def prompt_logprobs(vocab: int, num_rows: int, top: int, repeats: int, device: torch.device) -> dict:
    """One prompt chunk's log-prob rows through the Sampler: peak memory growth and time."""
    from omniinfer.sampling.metadata import PromptLogprobRows
    from omniinfer.sampling.params import SamplingParams
    from omniinfer.sampling.sampler import Sampler

    g = torch.Generator(device).manual_seed(0)
    # (made in place: a temporary as big would raise the peak before the call)
    logits = torch.empty(num_rows + 1, vocab, device=device).normal_(generator=g).mul_(8)  # + the sampling row
    md = metadata(SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=top), 1)
    targets = torch.randint(0, vocab, (num_rows,), generator=torch.Generator().manual_seed(0)).tolist()
    md.prompt_rows.append(PromptLogprobRows(md.seqs[0], 1, targets, 1))
    sampler = Sampler(vocab)
    before = peak_bytes(device)
    start = time.perf_counter()
    out, _ = sampler(logits, md)
    first = time.perf_counter() - start
    peak = (peak_bytes(device) - before) / 1024
    assert len(out.prompt_logprobs[0][1]) == num_rows
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, md)
        times.append(time.perf_counter() - start)
    return {"rows": num_rows, "top": top, "logits_mb": logits.numel() * 4 / 2**20,
            "peak_growth_mb": peak / 1024, "first_ms": 1e3 * first, "ms": 1e3 * statistics.median(times)}


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
    parser.add_argument("--prompt-logprobs", type=int, metavar="ROWS",
                        help="instead: one prompt chunk of ROWS log-prob rows (see above)")
    parser.add_argument("--top", type=int, default=1, help="with --prompt-logprobs: its prompt_logprobs")
    parser.add_argument("--platform", default=None,
                        help="the logits on this platform's device (default: the CPU's memory)")
    parser.add_argument("--json", help="append the result to this JSON file")
    args = parser.parse_args()
    for name in ("vocab", "repeats", "prompt_logprobs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: expected a positive number")
    if args.top < 0:
        parser.error(f"--top {args.top}: expected 0 or more")
    device = torch.device("cpu")
    if args.platform is not None:
        from omniinfer.platforms.registry import get_registry

        device = get_registry().select_platform(args.platform).device(0)
    if args.prompt_logprobs:
        from omniinfer.benchmarks.perf import append_json

        result = prompt_logprobs(args.vocab, args.prompt_logprobs, args.top, args.repeats, device)
        print(machine_line())
        print(f"device: {device}")
        print(f"prompt log-probs of {result['rows']} rows (top {result['top']}) of a {args.vocab}-token "
              f"vocabulary; the logits: {result['logits_mb']:.0f} MB")
        print(f"  peak memory growth beyond the logits: {result['peak_growth_mb']:.1f} MB"
              + ("" if device.type == "cpu" else " (the device allocator's)"))
        print(f"  first call {result['first_ms']:.1f} ms; median of {args.repeats} more: {result['ms']:.1f} ms")
        if args.json:
            append_json(args.json, {"vocab": args.vocab, "device": str(device), "prompt_logprobs": result})
        return
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
            logits = (torch.randn(rows, args.vocab, generator=g) * scale).to(device)
            for name in settings:
                sampler = Sampler(args.vocab, torch.Generator(device).manual_seed(1))
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
    print(f"the Sampler on a {args.vocab}-token vocabulary ({device}), median of {args.repeats} calls "
          "(ms per call, each ending with its tokens on the host)")
    rows_out = []
    for i, (name, scale, rows, _, _) in enumerate(cases):
        ms = 1e3 * statistics.median(times[i])
        rows_out.append({"setting": name, "scale": scale, "rows": rows, "ms": ms})
        print(f"  {name:<20} scale {scale:<4g} {rows:>3} rows: {ms:9.2f} ms")
    for scale in args.scale:
        logits = next(c[4] for c in cases if c[1] == scale)
        print(f"  scale {scale:g}: a row's top-p 0.95 set holds {top_p_set(logits, 0.95)} tokens (median row)")
    if args.json:
        append_json(args.json, {"vocab": args.vocab, "device": str(device), "repeats": args.repeats,
                                "results": rows_out})


if __name__ == "__main__":
    main()
