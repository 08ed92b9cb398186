"""Shared fixtures: tiny checkpoints built once per session, and a transformers reference."""

from __future__ import annotations

import os

os.environ.setdefault("OMNIINFER_CPU_THREADS", "1")  # tiny models: one thread is fastest and stable
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
if not (torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())):
    # the core's Triton kernels run on CPU tensors only interpreted (decided at their import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from omniinfer.testing.tiny_models import build_tiny_checkpoint  # noqa: E402

CHECKPOINTS = {
    "llama": dict(arch="llama"),
    "mistral": dict(arch="mistral"),
    "qwen2": dict(arch="qwen2"),
    "llama_tied": dict(arch="llama", tie_word_embeddings=True),
    "llama3_rope": dict(arch="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, rope_theta=500000.0),
    "llama_sharded": dict(arch="llama", max_shard_size="100KB"),
    "mistral_window": dict(arch="mistral", sliding_window=24),
    "llama_bf16": dict(arch="llama", dtype="bfloat16"),
    "qwen3": dict(arch="qwen3"),
    "qwen3_norms": dict(arch="qwen3", norm_jitter=0.2),  # (each norm its own weight: q_norm is not k_norm)
    "gemma2": dict(arch="gemma2"),
    "gemma3": dict(arch="gemma3"),
    "phi3": dict(arch="phi3"),
    # Phi-4-mini's partial rotary: 12 of each 16-wide head's features turn (longrope: 6 factors)
    "phi3_partial": dict(arch="phi3", rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [2.0 + 0.3 * i for i in range(6)]}),
    # tensor parallelism: 1 KV head (replicated across ranks), vocabulary not divisible by 2 or 4
    "llama_kv1": dict(arch="llama", num_key_value_heads=1, vocab_size=389),
    # mixtures of experts (tests/test_moe_models.py): 8 experts, 2 or 3 routed per token
    "mixtral": dict(arch="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=64),
    "mixtral_window": dict(arch="mixtral", num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                           sliding_window=24),
    "qwen2_moe": dict(arch="qwen2_moe", num_hidden_layers=3, num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=32, shared_expert_intermediate_size=48,
                      decoder_sparse_step=1, mlp_only_layers=[1]),
    "qwen3_moe": dict(arch="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=32),
}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """checkpoint_dir(name) -> path of a tiny checkpoint from CHECKPOINTS, built on first use."""
    root = tmp_path_factory.mktemp("checkpoints")
    built = {}

    def get(name: str) -> str:
        if name not in built:
            spec = dict(CHECKPOINTS[name])
            built[name] = build_tiny_checkpoint(str(root / name), spec.pop("arch"), **spec)
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(path, prompt_ids, max_new_tokens) -> transformers' greedy continuation (cached)."""
    from transformers import AutoModelForCausalLM

    models, cache = {}, {}

    def run(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (path, tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            if path not in models:
                models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            ids = torch.tensor([prompt_ids])
            with torch.no_grad():
                out = models[path].generate(ids, attention_mask=torch.ones_like(ids),
                                            max_new_tokens=max_new_tokens,
                                            do_sample=False, eos_token_id=None, pad_token_id=0)
            cache[key] = out[0, len(prompt_ids):].tolist()
        return cache[key]

    return run


@pytest.fixture(scope="session")
def hf_logprobs():
    """hf_logprobs(path, token_ids) -> [len, vocab] log_softmax of transformers' logits."""
    from transformers import AutoModelForCausalLM

    models = {}

    def run(path: str, token_ids: list[int]) -> torch.Tensor:
        if path not in models:
            models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = models[path](torch.tensor([token_ids])).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return run
