"""Gemma 2 and Gemma 3 (text) GGUF files, written as llama.cpp's converter writes them (norm weights
stored as 1 + w; no key for the layer pattern, the sliding layers' rope base or the attention
scale, which llama.cpp's rules supply: gguf_file._GEMMA), against transformers on the checkpoint the
file came from (transformers' own GGUF reader takes Gemma's defaults for what the file does not
say: a 256-wide attention scale, wrong for these tiny heads)."""

from __future__ import annotations

import json
import os

import pytest

from omniinfer import LLM, SamplingParams
from omniinfer.benchmarks.gguf_export import export
from omniinfer.quantization.gguf_file import GGUFFile
from omniinfer.testing.greedy import agreed_steps, hf_greedy
from omniinfer.testing.tiny_models import build_tiny_checkpoint

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7, 20], list(range(40, 75))]  # (the second passes the sliding window of 8)
FULL, SLIDING = "full_attention", "sliding_attention"


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """arch -> a tiny checkpoint in the shape llama.cpp's rules assume: the attention scale of the
    head size, Gemma 3's five sliding layers to one global."""
    root = tmp_path_factory.mktemp("gemma")
    return {
        "gemma2": build_tiny_checkpoint(str(root / "gemma2"), "gemma2", num_hidden_layers=4, query_pre_attn_scalar=16,
                                        tie_word_embeddings=True, seed=5),
        "gemma3": build_tiny_checkpoint(str(root / "gemma3"), "gemma3", num_hidden_layers=6, query_pre_attn_scalar=16,
                                        layer_types=[SLIDING] * 5 + [FULL], seed=6),
    }


def generate(path: str, tokenizer: str) -> list[list[int]]:
    llm = LLM(path, tokenizer=tokenizer, num_kv_blocks=64)
    try:
        return [list(o.outputs[0].token_ids) for o in
                llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_the_files_config_is_the_checkpoints(gemma, arch):
    model = gemma[arch]
    with open(os.path.join(model, "config.json")) as f:
        want = json.load(f)
    cfg = GGUFFile(export(model, os.path.join(model, "f32.gguf"), "f32")).hf_config()
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "head_dim", "final_logit_softcapping"):
        assert cfg[key] == want[key], key
    if arch == "gemma2":
        assert cfg["attn_logit_softcapping"] == want["attn_logit_softcapping"]
    else:  # the global layers' base and linear scaling from the file, the sliding ones' base llama.cpp's
        full = want["rope_parameters"][FULL]
        assert cfg["rope_theta"] == full["rope_theta"] and cfg["rope_scaling"]["factor"] == full["factor"]
        assert cfg["rope_local_base_freq"] == want["rope_parameters"][SLIDING]["rope_theta"]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_file_follows_transformers_on_its_checkpoint(gemma, arch, monkeypatch):
    """The f32 file token for token; a q8_0 file up to a near-tie (its weights rounded), with float
    and with int8 activations (the CPU kernels' default)."""
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    model = gemma[arch]
    want = hf_greedy(model, PROMPTS, PARAMS.max_tokens)
    got = generate(export(model, os.path.join(model, "f32.gguf"), "f32"), model)
    assert got == [tokens for tokens, _ in want]
    path = export(model, os.path.join(model, "q8_0.gguf"), "q8_0")
    for mode in ("float", "int8"):
        monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", mode)
        for tokens, (_, steps) in zip(generate(path, model), want):
            agreed_steps(tokens, steps)
