"""The `omniinfer` command. `--version` answers without importing torch."""

from __future__ import annotations

import argparse
import json
import os
import sys

from omniinfer.version import __version__


def _env(args: argparse.Namespace) -> int:
    from omniinfer.entrypoints.env_report import collect, format_report

    report = collect()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniinfer", description="omniinfer: LLM inference on "
                                     "any vendor's hardware through device plugins")
    parser.add_argument("--version", "-V", action="version", version=f"omniinfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    env = sub.add_parser("env", help="report the torch build, plugins, platforms and hardware")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    env.set_defaults(func=_env)
    from omniinfer.entrypoints import cli_bench, cli_generate, cli_serve

    cli_generate.register(sub)
    cli_serve.register(sub)
    cli_bench.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["--version"], ["-V"]):  # answered before anything imports torch
        print(f"omniinfer {__version__}")
        return 0
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except (ValueError, TypeError) as e:  # user mistakes (PluginError is a ValueError): a message, not a traceback
        if os.environ.get("OMNIINFER_TRACEBACK"):
            raise
        print(f"omniinfer {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
