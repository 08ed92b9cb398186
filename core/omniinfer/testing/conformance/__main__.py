"""python -m omniinfer.testing.conformance --platform NAME [--backend NAME ...] [pytest args]"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    import pytest

    parser = argparse.ArgumentParser(prog="python -m omniinfer.testing.conformance",
                                     description="Run the attention-backend conformance kit.")
    parser.add_argument("--platform", help="platform to test (default: the best available)")
    parser.add_argument("--backend", action="append", default=[],
                        help="only this attention backend (repeatable)")
    args, rest = parser.parse_known_args(argv)
    pytest_args = ["-p", "omniinfer.testing.conformance.plugin",
                   "--pyargs", "omniinfer.testing.conformance"]
    if args.platform:
        pytest_args += ["--omniinfer-platform", args.platform]
    for name in args.backend:
        pytest_args += ["--omniinfer-backend", name]
    return pytest.main(pytest_args + rest)


if __name__ == "__main__":
    sys.exit(main())
