"""`omniinfer serve [MODEL]`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import os
import sys

from omniinfer.entrypoints.cli_generate import default_model
from omniinfer.entrypoints.engine_flags import (
    _parse_bool,
    add_engine_args,
    engine_kwargs,
    env_default,
)
from omniinfer.entrypoints.openai.tools.serving import add_tool_flags, tool_config
from omniinfer.entrypoints.serve_options import add_serve_options

DEMO_MODEL_NAME = "omniinfer-demo"


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a checkpoint over an OpenAI-compatible HTTP API. Every "
                       "flag also reads OMNIINFER_<FLAG> (e.g. OMNIINFER_PORT, OMNIINFER_API_KEY).")
    p.add_argument("model", nargs="?", default=env_default("model", None),
                   help="checkpoint directory (default: the shipped demo model)")
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                   help="the same as the positional MODEL (vLLM's spelling)")
    p.add_argument("--host", default=env_default("host", "127.0.0.1"),
                   help="address to bind (default: %(default)s; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=env_default("port", 8000, int),
                   help="default: %(default)s")
    p.add_argument("--api-key", default=env_default("api_key", None),
                   help="require 'Authorization: Bearer KEY' on the API routes")
    p.add_argument("--served-model-name", default=env_default("served_model_name", None),
                   help="the model id clients send (default: MODEL as given)")
    p.add_argument("--chat-template", default=env_default("chat_template", None),
                   help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    p.add_argument("--stats-interval", type=float, default=env_default("stats_interval", 10.0, float),
                   help="seconds between stats log lines while busy; 0 disables (default: %(default)s)")
    p.add_argument("--uvicorn-log-level", default=env_default("uvicorn_log_level", "info"),
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--metrics-prefix", default=env_default("metrics_prefix", "omniinfer"),
                   choices=["omniinfer", "vllm"],
                   help="namespace of the /metrics series: 'vllm' names them as vLLM does, for "
                   "its dashboards and alerts (default: %(default)s)")
    p.add_argument("--enable-log-requests", nargs="?", const=True, type=_parse_bool,
                   default=env_default("enable_log_requests", False, bool),
                   help="log one line per request: its id, prompt length and parameters")
    p.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false",
                   help="no request log lines (the default; vLLM's older flag)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats log lines (the same as --stats-interval 0)")
    limits = p.add_argument_group("limits (see docs/serving.md)")
    limits.add_argument("--max-n", type=int, default=env_default("max_n", 128, int),
                        help="most choices (n) per prompt (default: %(default)s)")
    limits.add_argument("--max-prompt-tokens", type=int,
                        default=env_default("max_prompt_tokens", None, int),
                        help="most tokens in one prompt (default: max_model_len - 1)")
    limits.add_argument("--max-body-bytes", type=int,
                        default=env_default("max_body_bytes", 16 << 20, int),
                        help="larger request bodies get 413 (default: %(default)s, 16 MiB)")
    limits.add_argument("--shutdown-timeout", type=float,
                        default=env_default("shutdown_timeout", 30.0, float),
                        help="seconds running requests may still finish after SIGTERM; then they "
                        "end with an error (default: %(default)s)")
    limits.add_argument("--keep-alive-on-engine-death", nargs="?", const=True, type=_parse_bool,
                        default=env_default("keep_alive_on_engine_death", False, bool),
                        help="keep serving (503 on /health, 500 on requests) after the engine "
                        "failed, instead of exiting with status 1 for a supervisor to restart")
    add_tool_flags(p, env_default)
    add_serve_options(p, env_default)
    add_engine_args(p)
    p.set_defaults(func=run)


def read_chat_template(value: str | None) -> str | None:
    if value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


def run(args: argparse.Namespace) -> int:
    from omniinfer.entrypoints.openai.limits import ServerLimits
    from omniinfer.entrypoints.openai.protocol import GENERATION_DEFAULTS
    from omniinfer.entrypoints.openai.run import run_server
    from omniinfer.entrypoints.serve_options import serve_options

    model, name = args.model, args.served_model_name
    if args.model_flag is not None:
        if model not in (None, env_default("model", None), args.model_flag):
            print(f"error: two models given: {model!r} and --model {args.model_flag!r}",
                  file=sys.stderr)
            return 2
        model = args.model_flag
    if not model:
        model = default_model()
        if model is None:
            print("error: no MODEL given and no demo model is installed", file=sys.stderr)
            return 2
        name = name or DEMO_MODEL_NAME
    try:
        limits = ServerLimits(max_n=args.max_n, max_prompt_tokens=args.max_prompt_tokens,
                              max_body_bytes=args.max_body_bytes,
                              shutdown_timeout_s=args.shutdown_timeout)
        tools = tool_config(args)
        options = serve_options(args, GENERATION_DEFAULTS)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_server(model, engine_kwargs(args), host=args.host, port=args.port,
                      model_name=name or model, api_key=args.api_key,
                      chat_template=read_chat_template(args.chat_template),
                      stats_interval_s=0 if args.disable_log_stats else args.stats_interval,
                      uvicorn_log_level=args.uvicorn_log_level, limits=limits,
                      keep_alive_on_engine_death=args.keep_alive_on_engine_death,
                      metrics_prefix=args.metrics_prefix, log_requests=args.enable_log_requests,
                      tools=tools, options=options)
