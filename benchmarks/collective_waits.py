"""What waiting for gloo in slices costs (distributed/waits.py), two local processes taking turns
round by round between the way before and the way now:

* `--op all-reduce`: all-reduces of `--numel` floats, plain (`dist.all_reduce`) against
  `waits.run` (async, waited for in 0.2 s slices so that the executor can abandon it);
* `--op stage`: the pipeline's stage-to-stage exchange, `--numel` floats from rank 0 to rank 1
  and back (the hidden states out, the logits back), as `isend`/`irecv` (what pp_send/pp_recv
  were) against broadcasts in a 2-rank group through `waits.run` (what they are).

    python benchmarks/collective_waits.py [--op all-reduce|stage] [--numel 896] [--iters 500]
                                          [--rounds 10]

Prints each way's median microseconds per operation (per round trip for `stage`) over the rounds,
every round's figure, and the ratio now / before. The processes share this machine's cores with
nothing else of omniinfer's: the figure is gloo's own round trip (both ranks' threads scheduled
in turn).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_line  # noqa: E402

WAYS = {"all-reduce": ("plain", "sliced"), "stage": ("send/recv", "broadcast")}


def rank_main(rank: int, port: int, op: str, numel: int, iters: int, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from omniinfer.distributed import waits

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        group = dist.new_group([0, 1], backend="gloo")
        x = torch.ones(numel)
        before, now = WAYS[op]

        def once(way: str) -> None:
            if way == "plain":
                dist.all_reduce(x, group=group)
            elif way == "sliced":
                waits.run(dist.all_reduce, x, group=group)
            elif way == "send/recv":  # rank 0 -> 1, then 1 -> 0
                for src in (0, 1):
                    (dist.isend if rank == src else dist.irecv)(x, 1 - rank, group=group).wait()
            else:
                for src in (0, 1):
                    waits.run(dist.broadcast, x, src=src, group=group)

        for _ in range(50):
            once(before)
            once(now)
        us = {before: [], now: []}
        for r in range(rounds):
            for way in ((before, now) if r % 2 == 0 else (now, before)):
                t0 = time.perf_counter()
                for _ in range(iters):
                    once(way)
                us[way].append((time.perf_counter() - t0) / iters * 1e6)
        if rank == 0:
            with open(out, "w") as f:
                for way, values in us.items():
                    f.write(f"{way} {' '.join(f'{v:.1f}' for v in values)}\n")
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=sorted(WAYS), default="all-reduce")
    parser.add_argument("--numel", type=int, default=896, help="floats a rank contributes (medium's hidden size)")
    parser.add_argument("--iters", type=int, default=500, help="all-reduces a round")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    for name in ("numel", "iters", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")

    import tempfile

    import torch.multiprocessing as mp

    from omniinfer.executor.distributed import free_port

    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "us.txt")
        mp.spawn(rank_main, args=(free_port(), args.op, args.numel, args.iters, args.rounds, out), nprocs=2)
        with open(out) as f:
            us = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in f}
    medians = {way: statistics.median(values) for way, values in us.items()}
    what = ("all-reduce" if args.op == "all-reduce" else "stage-to-stage round trip (0 -> 1 -> 0)")
    print(f"gloo {what} of {args.numel} floats between 2 processes, {args.rounds} rounds of {args.iters}, "
          "taking turns")
    before, now = WAYS[args.op]
    for way in (before, now):
        print(f"  {way:9s} median {medians[way]:8.1f} us   rounds: {' '.join(f'{v:.0f}' for v in us[way])}")
    print(f"  {now} / {before}: {medians[now] / medians[before]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
