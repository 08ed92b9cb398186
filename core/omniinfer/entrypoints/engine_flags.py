"""Every engine argument as a command-line flag that also reads OMNIINFER_<NAME>."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing

from omniinfer.config import EngineArgs


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def json_value(kind: type, what: str):
    """An argparse type: the flag's text parsed as JSON, which must be a `kind` ("a JSON object")."""
    def parse(text: str):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r} ({e})") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


_parse_json_object = json_value(dict, "a JSON object")


def _base_type(annotation) -> type:
    hints = typing.get_type_hints(EngineArgs)
    tp = hints[annotation] if isinstance(annotation, str) else annotation
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and args:
        return args[0]
    return tp


def env_name(field: str) -> str:
    return "OMNIINFER_" + field.upper()


# vLLM's short spellings
ALIASES = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",)}


def add_engine_args(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ("model",)) -> None:
    """One flag per EngineArgs field (`--block-size`); a boolean also takes `--no-<flag>`
    (vLLM's `--no-enable-prefix-caching`) and `--flag false`."""
    group = parser.add_argument_group("engine arguments (each also read from OMNIINFER_<NAME>)")
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        base = _base_type(f.name)
        flag = "--" + f.name.replace("_", "-")
        kind = {bool: _parse_bool, dict: _parse_json_object}.get(base, base)
        env = os.environ.get(env_name(f.name))
        default = f.default
        if env is not None:
            try:
                default = kind(env)
            except (ValueError, argparse.ArgumentTypeError) as e:
                parser.error(f"{env_name(f.name)}={env!r}: {e}")
        extra = {"nargs": "?", "const": True} if base is bool else {}
        group.add_argument(flag, *ALIASES.get(f.name, ()), dest=f.name, type=kind, default=default,
                           metavar=f.name.upper() if base is not bool else None, **extra,
                           help=f"default: {default!r}")
        if base is bool:
            group.add_argument("--no-" + flag[2:], dest=f.name, action="store_false",
                               help=argparse.SUPPRESS)


def engine_kwargs(args: argparse.Namespace, *, skip: tuple[str, ...] = ("model",)) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
            if f.name not in skip and hasattr(args, f.name)}


def env_default(name: str, default, kind=str):
    """The default of a non-engine flag: OMNIINFER_<NAME> when set (parsed as `kind`), else `default`."""
    text = os.environ.get(env_name(name))
    if text is None:
        return default
    try:
        return _parse_bool(text) if kind is bool else kind(text)
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise SystemExit(f"error: {env_name(name)}={text!r}: {e}") from None
