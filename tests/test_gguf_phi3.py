"""Phi-3 GGUF files (llama.cpp's `phi3`: q/k/v in one `attn_qkv` tensor, gate and up in one
`ffn_up`, as Hugging Face's Phi-3 fuses them; the 128k models' longrope as `rope_factors_long` /
`rope_factors_short` tensors), written as llama.cpp's converter writes them, against transformers:
on the same file (which it dequantises) where it reads it all, on the checkpoint the file came from
where it does not (it drops the longrope factors)."""

from __future__ import annotations

import os

import gguf
import pytest
from transformers import AutoConfig

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


@pytest.fixture(scope="module")
def partial(tmp_path_factory):
    """Phi-4-mini's partial rotary (0.75 of each 16-wide head: 12 features turn), with longrope
    factors of its 6 frequencies."""
    root = tmp_path_factory.mktemp("phi3_partial")
    return build_tiny_checkpoint(str(root / "ckpt"), "phi3", seed=5, **SHAPE, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.1 * i for i in range(6)], "long_factor": [2.0 + 0.3 * i for i in range(6)]})


def test_a_partial_rotary_phi3_file_follows_transformers(partial, monkeypatch):
    """The file says the rotary dims as llama.cpp's converter writes them (n_rot 12, 6 factors
    each). transformers' own GGUF reader drops them (its phi3 config turns whole heads), so the
    reference is transformers on the checkpoint for the f32 file, and on the q8_0 file's
    dequantised weights with the checkpoint's config for that one."""
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    f32 = export(partial, os.path.join(partial, "f32.gguf"), "f32")
    file = GGUFFile(f32)
    assert file.field("phi3.rope.dimension_count") == 12
    cfg = file.hf_config()
    assert cfg["partial_rotary_factor"] == 0.75 and len(cfg["rope_scaling"]["long_factor"]) == 6
    want = hf_greedy(partial, [SHORT, LONG[:50]], PARAMS.max_tokens)  # (within longrope's original 64)
    assert generate(f32, partial, [SHORT, LONG[:50]]) == [tokens for tokens, _ in want]
    q8 = export(partial, os.path.join(partial, "q8_0.gguf"), "q8_0")
    want = hf_greedy(partial, [SHORT, LONG[:50]], PARAMS.max_tokens, "q8_0.gguf",
                     config=AutoConfig.from_pretrained(partial))
    assert generate(q8, partial, [SHORT, LONG[:50]]) == [tokens for tokens, _ in want]


@pytest.mark.parametrize("dims", [7, 18, 0])
def test_a_bad_rotary_dimension_count_is_refused_by_name(phi3, monkeypatch, tmp_path, dims):
    plain, _ = phi3
    original = gguf.GGUFWriter.add_rope_dimension_count
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_count", lambda self, n: original(self, dims))
    path = export(plain, str(tmp_path / "bad.gguf"), "q8_0")
    with pytest.raises(GGUFError, match=rf"phi3.rope.dimension_count={dims}: expected an even count of the "
                                        r"16 features of a head, at least 2"):
        LLM(path, tokenizer=plain)
