"""Shared by the benchmark scripts: the workload shapes and random checkpoints built on the fly."""

from __future__ import annotations

import os

SHAPES = {
    # Llama shape from the performance issue
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  intermediate_size=1024, vocab_size=32000, arch="llama"),
    # shaped like Qwen2.5-0.5B
    "medium": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                   intermediate_size=4864, vocab_size=151936, arch="qwen2", tie_word_embeddings=True),
    # for the CI smoke test of the scripts: every code path, seconds to run
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, arch="llama"),
    # a one-layer model of the small vocabulary (host-overhead runs swap its forward out)
    "trivial": dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=128, vocab_size=32000, arch="llama"),
}


def build_random_checkpoint(path: str, shape: str, dtype: str = "float32") -> str:
    """A randomly initialised checkpoint of `shape` (with the tiny test tokenizer) at `path`."""
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    return build_tiny_checkpoint(path, arch, dtype=dtype, max_position_embeddings=2048,
                                 initializer_range=0.02, **spec)


def model_flops(shape: dict, num_prompts: int, input_len: int, output_len: int) -> float:
    """Model FLOPs of the workload: linear layers for every token, the LM head only where
    logits are needed (the last prompt token and every generated one but the last), and
    attention (QK^T and PV) over each token's context."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head = h // heads
    inter, vocab = shape["intermediate_size"], shape["vocab_size"]
    per_layer = h * (heads + 2 * kv_heads) * head + heads * head * h + 3 * h * inter
    tokens = num_prompts * (input_len + output_len - 1)  # the last sampled token is never fed back
    linear = 2 * per_layer * layers * tokens
    lm_head = 2 * h * vocab * num_prompts * output_len
    # context seen by each token: positions 1..input_len+output_len-1
    total_ctx = sum(range(1, input_len + output_len))
    attention = 4 * heads * head * layers * num_prompts * total_ctx
    return float(linear + lm_head + attention)


def quiet() -> None:
    os.environ.setdefault("OMNIINFER_LOG_LEVEL", "WARNING")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
