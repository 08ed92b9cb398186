"""What waiting for a gloo all-reduce in slices costs (distributed/waits.py): two local processes
all-reduce a tensor of `--numel` floats, plain (`dist.all_reduce`) and through `waits.run` (async,
waited for in 0.2 s slices so that the executor can abandon it), taking turns round by round.

    python benchmarks/collective_waits.py [--numel 896] [--iters 500] [--rounds 10]

Prints each way's median microseconds per all-reduce over the rounds, every round's figure, and
the ratio sliced / plain. The processes share this machine's cores with nothing else of
omniinfer's: the figure is gloo's own round trip (both ranks' threads scheduled in turn).
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


def rank_main(rank: int, port: int, numel: int, iters: int, rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from omniinfer.distributed import waits

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        group = dist.new_group([0, 1], backend="gloo")
        x = torch.ones(numel)
        for _ in range(50):
            dist.all_reduce(x, group=group)
        us = {"plain": [], "sliced": []}
        for r in range(rounds):
            for way in (("plain", "sliced") if r % 2 == 0 else ("sliced", "plain")):
                t0 = time.perf_counter()
                for _ in range(iters):
                    if way == "plain":
                        dist.all_reduce(x, group=group)
                    else:
                        waits.run(dist.all_reduce, x, group=group)
                us[way].append((time.perf_counter() - t0) / iters * 1e6)
        if rank == 0:
            with open(out, "w") as f:
                for way, values in us.items():
                    f.write(f"{way} {' '.join(f'{v:.1f}' for v in values)}\n")
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        mp.spawn(rank_main, args=(free_port(), args.numel, args.iters, args.rounds, out), nprocs=2)
        with open(out) as f:
            us = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in f}
    medians = {way: statistics.median(values) for way, values in us.items()}
    print(f"gloo all-reduce of {args.numel} floats between 2 processes, {args.rounds} rounds of {args.iters}, "
          "taking turns")
    for way in ("plain", "sliced"):
        print(f"  {way:6s} median {medians[way]:8.1f} us   rounds: {' '.join(f'{v:.0f}' for v in us[way])}")
    print(f"  sliced / plain: {medians['sliced'] / medians['plain']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
