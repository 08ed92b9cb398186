"""Phi-3 GGUF files (llama.cpp's `phi3`: q/k/v in one `attn_qkv` tensor, gate and up in one
`ffn_up`, as Hugging Face's Phi-3 fuses them; the 128k models' longrope as `rope_factors_long` /
`rope_factors_short` tensors), written as llama.cpp's converter writes them, against transformers:
on the same file (which it dequantises) where it reads it all, on the checkpoint the file came from
where it does not (it drops the longrope factors)."""

from __future__ import annotations

import os

import gguf
import pytest

from omniinfer import LLM, SamplingParams
from omniinfer.benchmarks.gguf_export import export
from omniinfer.quantization.gguf_file import GGUFError, GGUFFile
from omniinfer.testing.greedy import agreed_steps, hf_greedy, kernel_names
from omniinfer.testing.tiny_models import FAMILY_SETTINGS, build_tiny_checkpoint

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SHORT, LONG = [1, 5, 9, 33, 7, 20], list(range(40, 110))  # (LONG passes longrope's original 64 positions)
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=16, num_key_value_heads=4, vocab_size=1000)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    """(plain: rope without scaling, longrope: the tiny family's longrope) checkpoints."""
    root = tmp_path_factory.mktemp("phi3")
    plain = build_tiny_checkpoint(str(root / "plain"), "phi3", seed=3, **SHAPE,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return plain, build_tiny_checkpoint(str(root / "longrope"), "phi3", seed=4, **SHAPE)


def generate(path: str, tokenizer: str, prompts) -> list[list[int]]:
    llm = LLM(path, tokenizer=tokenizer, num_kv_blocks=64)
    try:
        kinds = kernel_names(llm)
        assert not any(k.startswith("reference") for k in kinds), kinds
        return [list(o.outputs[0].token_ids) for o in
                llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("file_type", ["q4_k_m", "q8_0"])
def test_a_phi3_file_follows_transformers_on_the_same_file(phi3, file_type, monkeypatch):
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    plain, _ = phi3
    path = export(plain, os.path.join(plain, f"{file_type}.gguf"), file_type)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.0.attn_qkv.weight" in names and "blk.0.attn_q.weight" not in names
    got = generate(path, plain, [SHORT, LONG])
    want = hf_greedy(plain, [SHORT, LONG], PARAMS.max_tokens, os.path.basename(path))
    assert got == [tokens for tokens, _ in want]
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "int8")  # (the default: up to a near-tie)
    for tokens, (_, steps) in zip(generate(path, plain, [SHORT, LONG]), want):
        agreed_steps(tokens, steps)


def test_a_longrope_phi3_file_runs_as_its_checkpoint(phi3, monkeypatch):
    """The longrope factors come back from the file's tensors: the f32 file runs token for token
    as its checkpoint does in omniinfer, both prompts; and as transformers on the checkpoint within
    the original context (past it, transformers switches the whole sequence to the long factors:
    tests/test_model_families.py)."""
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    _, longrope = phi3
    path = export(longrope, os.path.join(longrope, "f32.gguf"), "f32")
    scaling = GGUFFile(path).hf_config()["rope_scaling"]
    settings = FAMILY_SETTINGS["phi3"]
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 64
    for key in ("long_factor", "short_factor"):
        assert scaling[key] == pytest.approx(settings["rope_parameters"][key], rel=1e-6)
    got = generate(path, longrope, [SHORT, LONG])
    assert got == generate(longrope, longrope, [SHORT, LONG])
    [(tokens, _)] = hf_greedy(longrope, [SHORT], PARAMS.max_tokens)
    assert got[0] == tokens


def test_partial_rotary_is_refused_by_name(phi3, monkeypatch, tmp_path):
    plain, _ = phi3
    original = gguf.GGUFWriter.add_rope_dimension_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", lambda self, n: original(self, n // 2))
    path = export(plain, str(tmp_path / "partial.gguf"), "q8_0")
    with pytest.raises(GGUFError, match=r"phi3.rope.dimension_count=8 rotates part of each 16-wide head"):
        LLM(path, tokenizer=plain)
