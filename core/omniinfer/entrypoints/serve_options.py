"""`omniinfer serve` flags that vLLM launch lines carry: where sampling defaults come from
(`--generation-config`, `--override-generation-config`), how the HTTP server is reached
(`--root-path`, `--ssl-*`, CORS) and the structured-output backend (xgrammar is the one here)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from omniinfer.entrypoints.engine_flags import json_value
from omniinfer.sampling.params import SamplingParams

STRUCTURED_BACKENDS = ("auto", "xgrammar")


@dataclass
class GenerationOptions:
    """Sampling defaults for requests that leave them unset: 'auto' takes the checkpoint's
    generation_config.json, 'vllm' none (OpenAI's defaults), else a directory holding a
    generation_config.json; `overrides` go over either."""

    source: str = "auto"
    overrides: dict = field(default_factory=dict)

    def defaults(self, checkpoint_config: dict, allowed: tuple[str, ...]) -> dict:
        if self.source == "auto":
            base = checkpoint_config or {}
        elif self.source == "vllm":
            base = {}
        else:
            base = read_generation_config(self.source)
        return {**{k: base[k] for k in allowed if base.get(k) is not None}, **self.overrides}


@dataclass
class HttpOptions:
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    allowed_origins: list[str] | None = None  # CORS; None: no CORS headers (the default here)
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def read_generation_config(directory: str) -> dict:
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--generation-config {directory!r}: no generation_config.json there "
                         "(give 'auto', 'vllm' or a directory holding one)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def add_serve_options(parser, env_default) -> None:
    group = parser.add_argument_group("vLLM's serving flags (see docs/serving.md)")
    group.add_argument("--generation-config", default=env_default("generation_config", "auto"),
                       help="sampling defaults: 'auto' (the checkpoint's generation_config.json), "
                       "'vllm' (none) or a directory holding a generation_config.json")
    group.add_argument("--override-generation-config", type=json_value(dict, "a JSON object"),
                       default=env_default("override_generation_config", {}, json_value(dict, "a JSON object")),
                       help='defaults over those, e.g. \'{"temperature": 0.5}\'')
    group.add_argument("--root-path", default=env_default("root_path", ""),
                       help="the path prefix a proxy serves this app under")
    group.add_argument("--ssl-keyfile", default=env_default("ssl_keyfile", None))
    group.add_argument("--ssl-certfile", default=env_default("ssl_certfile", None))
    group.add_argument("--allowed-origins", type=json_value(list, "a JSON list"),
                       default=env_default("allowed_origins", None, json_value(list, "a JSON list")),
                       help='CORS origins, e.g. \'["*"]\' (default: no CORS headers)')
    group.add_argument("--allowed-methods", type=json_value(list, "a JSON list"), default=["*"])
    group.add_argument("--allowed-headers", type=json_value(list, "a JSON list"), default=["*"])
    group.add_argument("--allow-credentials", action="store_true")
    from omniinfer.entrypoints.openai.reasoning import PARSERS

    group.add_argument("--reasoning-parser", choices=sorted(PARSERS),
                       default=env_default("reasoning_parser", None),
                       help="put a thinking model's <think> text in the message's `reasoning` "
                       "(deepseek_r1: DeepSeek-R1, Qwen3 Thinking-2507; qwen3: Qwen3)")
    group.add_argument("--guided-decoding-backend", default=None,
                       help="structured outputs' backend: auto or xgrammar (the one here)")
    group.add_argument("--structured-outputs-config", type=json_value(dict, "a JSON object"), default=None,
                       help='e.g. \'{"backend": "xgrammar"}\'')


@dataclass
class ServeOptions:
    generation: GenerationOptions
    http: HttpOptions
    reasoning_parser: object = None  # reasoning.ReasoningParser


def serve_options(args: argparse.Namespace, allowed_generation_keys: tuple[str, ...]) -> ServeOptions:
    """The options of parsed flags; ValueError names the flag and what is allowed."""
    from omniinfer.entrypoints.openai.reasoning import PARSERS

    backends = [("--guided-decoding-backend", args.guided_decoding_backend)]
    config = args.structured_outputs_config or {}
    unknown = sorted(set(config) - {"backend"})
    if unknown:
        raise ValueError(f"--structured-outputs-config holds {', '.join(map(repr, unknown))}; the one "
                         "key allowed is 'backend'")
    backends.append(("--structured-outputs-config backend", config.get("backend")))
    for flag, value in backends:
        if value is not None and value not in STRUCTURED_BACKENDS:
            raise ValueError(f"{flag}={value!r} is not supported; allowed: "
                             f"{', '.join(STRUCTURED_BACKENDS)}")
    overrides = args.override_generation_config or {}
    bad = sorted(set(overrides) - set(allowed_generation_keys))
    if bad:
        raise ValueError(f"--override-generation-config holds {', '.join(map(repr, bad))}; allowed: "
                         f"{', '.join(allowed_generation_keys)}")
    try:
        SamplingParams(**overrides)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--override-generation-config: {e}") from None
    generation = GenerationOptions(args.generation_config, dict(overrides))
    if generation.source not in ("auto", "vllm"):
        read_generation_config(generation.source)  # (refused now, not once the model loaded)
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r}: no such file")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    http = HttpOptions(root_path=args.root_path, ssl_keyfile=args.ssl_keyfile,
                       ssl_certfile=args.ssl_certfile, allowed_origins=args.allowed_origins,
                       allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
                       allow_credentials=args.allow_credentials)
    parser = PARSERS[args.reasoning_parser] if args.reasoning_parser else None
    return ServeOptions(generation, http, parser)
