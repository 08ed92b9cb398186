"""xgrammar against llguidance on this machine: why omniinfer's structured outputs use xgrammar.

    pip install xgrammar llguidance
    python benchmarks/grammar_engines.py [--model DIR] [--batch 16] [--steps 40]

For the demo model's tokenizer (or --model's): the time to build each engine's view of the
vocabulary, to compile three JSON schemas (flat, nested with an enum array, a string pattern),
and to fill the next-token bitmask of --batch matchers per step while they walk a random
valid path (the per-step cost the engine pays). Each figure is the best of three runs. One
thread (set OMP_NUM_THREADS=1 for the torch parts too).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

SCHEMAS = {
    "flat": {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}}},
    "nested": {"type": "object", "required": ["user", "score"], "properties": {
        "user": {"type": "object", "required": ["id", "tags"], "properties": {
            "id": {"type": "integer"},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}}}},
        "score": {"type": "number"}}},
    "pattern": {"type": "object", "required": ["code", "ok"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "ok": {"type": "boolean"}}},
}


def _allowed(bitmask, vocab: int):
    import torch

    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def _walk(new_matcher, fill, accept, is_done, allocate, args, vocab: int) -> float:
    """Seconds per step to fill `batch` masks, over a random valid walk of `steps` tokens."""
    best = float("inf")
    for _ in range(3):
        names = list(SCHEMAS)
        matchers = [new_matcher(names[i % len(names)]) for i in range(args.batch)]
        bitmask = allocate(args.batch, vocab)
        rng, spent = random.Random(0), 0.0
        for _ in range(args.steps):
            start = time.perf_counter()
            for i, m in enumerate(matchers):
                fill(m, bitmask, i)
            spent += time.perf_counter() - start
            allowed = _allowed(bitmask, vocab)
            for i, m in enumerate(matchers):
                if not is_done(m):
                    accept(m, rng.choice(allowed[i].nonzero().flatten().tolist()))
        best = min(best, spent / args.steps)
    return best


def bench_xgrammar(tokenizer, vocab: int, args) -> dict:
    import xgrammar as xgr

    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out = {"vocabulary_ms": (time.perf_counter() - start) * 1e3, "compile_ms": {}}
    compiled = {}
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        compiled[name] = compiler.compile_json_schema(json.dumps(schema))
        out["compile_ms"][name] = (time.perf_counter() - start) * 1e3
    out["mask_ms_per_step"] = 1e3 * _walk(
        lambda n: xgr.GrammarMatcher(compiled[n]), lambda m, b, i: m.fill_next_token_bitmask(b, i),
        lambda m, t: m.accept_token(t), lambda m: m.is_terminated(), xgr.allocate_token_bitmask,
        args, vocab)
    return out


def bench_llguidance(tokenizer, vocab: int, args) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    out = {"vocabulary_ms": (time.perf_counter() - start) * 1e3, "compile_ms": {}}
    grammars = {}
    for name, schema in SCHEMAS.items():
        start = time.perf_counter()
        grammars[name] = llguidance.LLMatcher.grammar_from_json_schema(schema)
        llguidance.LLMatcher(ll_tokenizer, grammars[name])  # (compiles lazily: count a matcher)
        out["compile_ms"][name] = (time.perf_counter() - start) * 1e3
    out["mask_ms_per_step"] = 1e3 * _walk(
        lambda n: llguidance.LLMatcher(ll_tokenizer, grammars[n]),
        lambda m, b, i: lgt.fill_next_token_bitmask(m, b, i), lambda m, t: m.consume_token(t),
        lambda m: m.is_stopped(), lgt.allocate_token_bitmask, args, vocab)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="tokenizer directory (default: the demo model)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    from omniinfer.entrypoints.cli_generate import DEMO_MODEL

    path = args.model or DEMO_MODEL
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    print(f"vocabulary {vocab} tokens, batch {args.batch}, {args.steps} steps")
    for name, bench in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        try:
            r = bench(tokenizer, vocab, args)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        compiles = ", ".join(f"{k} {v:.2f}" for k, v in r["compile_ms"].items())
        print(f"{name}: vocabulary {r['vocabulary_ms']:.1f} ms; compile ms: {compiles}; mask "
              f"{r['mask_ms_per_step']:.3f} ms per step = "
              f"{r['mask_ms_per_step'] * 1e3 / args.batch:.1f} us per row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
