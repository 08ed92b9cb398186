"""KV-cache memory of one long sequence on a Gemma-3-shaped model: its sliding layers keeping
only the blocks inside their window (engine/kv_groups.py), against full attention in every layer.

The model is Gemma 3's layer pattern at a small width (random weights: memory does not depend
on them): `--layers` layers, five sliding to one global, window `--window`, KV heads and head
size as given. One request of `--tokens` tokens (its prompt, then 64 generated) runs through
the offline `LLM` engine, chunked prefill of `--chunk` tokens; after every step the blocks the
sequence holds in each pool are read from the scheduler and turned into bytes (each pool's block
bytes times its layers). The same checkpoint with every layer marked full attention is the
baseline. Printed: the most each run held while the sequence was alive (for the sliding run,
during a prefill chunk: the window plus the chunk), what it held at its last token, the cache
each run allocated (the window pool is sized for `max_num_seqs` such sequences), and the ratios.

    python benchmarks/sliding_kv.py [--tokens 4096] [--window 512] [--layers 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

GENERATED = 64


def build(path: str, args, full_everywhere: bool) -> str:
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    types = ["full_attention" if full_everywhere or (i + 1) % 6 == 0 else "sliding_attention"
             for i in range(args.layers)]
    return build_tiny_checkpoint(
        path, "gemma3", dtype="bfloat16", num_hidden_layers=args.layers, layer_types=types,
        sliding_window=args.window, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=args.kv_heads, head_dim=args.head_size, query_pre_attn_scalar=args.head_size,
        max_position_embeddings=args.tokens + 64)


def measure(path: str, args) -> dict:
    from omniinfer import LLM, SamplingParams
    from omniinfer.engine.kv_groups import HybridBlockManager

    block = 16
    llm = LLM(path, block_size=block, max_num_seqs=1, enable_chunked_prefill=True, num_scheduler_steps=1,
              max_num_batched_tokens=args.chunk, num_kv_blocks=-(-args.tokens // block) + 1)
    engine = llm.llm_engine
    blocks = engine.scheduler.blocks
    windows = engine.config.model.layer_windows
    num_sliding = sum(w is not None for w in windows) if isinstance(blocks, HybridBlockManager) else 0
    m = engine.config.model
    block_layer_bytes = 2 * block * m.num_kv_heads * m.head_size * m.dtype_bytes  # keys and values
    prompt = [3 + i % 300 for i in range(args.tokens - GENERATED)]
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=GENERATED, ignore_eos=True))
    most, tokens, last = 0, 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.seqs.values():
            if num_sliding:
                full, window = blocks.held_blocks(seq)
            else:
                full, window = len(blocks.block_table(seq)), 0
            held = (full * (len(windows) - num_sliding) + window * num_sliding) * block_layer_bytes
            most, tokens, last = max(most, held), max(tokens, seq.num_tokens), held
    allocated = sum(c.numel() * c.element_size() for c in engine.executor.worker.cache_engine.device_cache)
    engine.shutdown()
    return {"held_bytes": most, "last_held_bytes": last, "tokens": tokens, "allocated_bytes": allocated,
            "window_pool": bool(num_sliding), "layers": len(windows), "sliding_layers": num_sliding}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--json")
    args = parser.parse_args()
    for name in ("tokens", "window", "layers", "chunk"):
        if getattr(args, name) < (GENERATED + 1 if name == "tokens" else 1):
            parser.error(f"--{name}={getattr(args, name)} is too small")
    root = tempfile.mkdtemp(prefix="sliding_kv_")
    try:
        sliding = measure(build(os.path.join(root, "sliding"), args, False), args)
        full = measure(build(os.path.join(root, "full"), args, True), args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    from omniinfer.benchmarks.perf import machine_line

    held, alloc = sliding["held_bytes"] / full["held_bytes"], sliding["allocated_bytes"] / full["allocated_bytes"]
    last = sliding["last_held_bytes"] / full["last_held_bytes"]
    print(machine_line())
    print(f"Gemma-3-shaped: {sliding['layers']} layers ({sliding['sliding_layers']} sliding, window "
          f"{args.window}), {args.kv_heads} KV heads x {args.head_size}, bfloat16, one sequence of "
          f"{sliding['tokens']} tokens, blocks of 16, chunks of {args.chunk}")
    print(f"{'':<34} {'KV held, most':>14} {'at the last token':>18} {'cache allocated':>16}  (MiB)")
    for label, r in (("sliding layers keep their window", sliding), ("full attention in every layer", full)):
        print(f"{label:<34} {r['held_bytes'] / 2**20:>14.2f} {r['last_held_bytes'] / 2**20:>18.2f} "
              f"{r['allocated_bytes'] / 2**20:>16.2f}")
    print(f"{'ratio':<34} {held:>14.1%} {last:>18.1%} {alloc:>16.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sliding": sliding, "full": full, "held_ratio": held, "last_held_ratio": last,
                       "allocated_ratio": alloc,
                       "window": args.window}, f, indent=2)


if __name__ == "__main__":
    main()
