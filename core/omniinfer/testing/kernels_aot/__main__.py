"""python -m omniinfer.testing.kernels_aot [--op NAME ...] [--target NAME ...] [--jobs N]
                                         [--catalogue MODULE:FUNCTION ...] [--json PATH]
                                         [--device]

Exit status: 0 when every configuration compiled for every target without spills or
shared-memory overflow (or is listed in the refusal table), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omniinfer.testing.kernels_aot",
                                     description="Compile every catalogued Triton kernel "
                                                 "configuration for real GPU targets, no GPU needed.")
    parser.add_argument("--op", action="append", default=[], help="only this op (repeatable)")
    parser.add_argument("--target", action="append", default=[],
                        help="only this target, e.g. sm_90 or gfx942 (repeatable)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="compiler processes (default: the CPUs this process may use, at most 8)")
    parser.add_argument("--catalogue", action="append", default=[],
                        help="also compile the launches of MODULE:FUNCTION or FILE.py:FUNCTION")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    parser.add_argument("--device", action="store_true",
                        help="also compile for the GPU present and load each kernel there")
    args = parser.parse_args(argv)

    # the kernels must be compiled, not interpreted: triton decides when they are defined
    os.environ.pop("TRITON_INTERPRET", None)
    from omniinfer.testing.kernels_aot import run_check
    from omniinfer.testing.kernels_aot.report import table, to_json

    jobs = args.jobs or min(8, len(os.sched_getaffinity(0)))
    report = run_check(args.catalogue, ops=args.op, targets=args.target, jobs=jobs,
                       device=args.device)
    print(table(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(to_json(report))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
