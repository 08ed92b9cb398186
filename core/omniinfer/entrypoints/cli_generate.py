"""`omniinfer generate`: prompts in, text out."""

from __future__ import annotations

import argparse
import json
import os
import sys

from omniinfer.demo import demo_model_path
from omniinfer.entrypoints.engine_flags import add_engine_args, engine_kwargs

DEMO_MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "demo", "model")


def default_model() -> str | None:
    """The shipped demo model, when this installation has it."""
    try:
        return demo_model_path()
    except FileNotFoundError:
        return None


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text for prompts (arguments or a file)")
    p.add_argument("prompts", nargs="*", help="prompts (default: a few demo prompts)")
    p.add_argument("--model", default=os.environ.get("OMNIINFER_MODEL") or default_model(),
                   help="checkpoint directory (default: the shipped demo model)")
    p.add_argument("--prompts-file", help="a file with one prompt per line ('-' for stdin)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="always make --max-tokens tokens")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message through the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_args(p)
    p.set_defaults(func=run)


def _prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.prompts_file == "-":
        prompts += [line.rstrip("\n") for line in sys.stdin if line.strip()]
    elif args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts or ["Return the", "This module provides", "def "]


def run(args: argparse.Namespace) -> int:
    from omniinfer import LLM, SamplingParams

    if not args.model:
        print("error: no --model given and no demo model is installed", file=sys.stderr)
        return 2
    prompts = _prompts(args)
    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, n=args.n, seed=args.sampling_seed,
                            stop=args.stop, ignore_eos=args.ignore_eos)
    if args.chat:
        if not getattr(llm.get_tokenizer(), "chat_template", None):
            raise SystemExit("error: --chat needs a tokenizer with a chat template; this model has none")
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=not args.json)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    for out, prompt in zip(outputs, prompts):
        out.prompt = prompt
    for out in outputs:
        if args.json:
            print(json.dumps({"prompt": out.prompt, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in out.outputs]}))
        else:
            for c in out.outputs:
                print(f"{out.prompt!r} -> {c.text!r}")
    return 0
