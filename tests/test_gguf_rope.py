"""Llama 3.1+ GGUF files carry their rope scaling as a 'rope_freqs.weight' tensor: llama.cpp's
converter writes the checkpoint's llama3 scaling as the factor each rotary frequency is divided by
(and transformers' GGUF loader drops it). omniinfer reads it as the rope scaling `freq_factors`;
checked against transformers on the checkpoint the file was written from."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from omniinfer import LLM, SamplingParams  # noqa: E402
from omniinfer.benchmarks import gguf_export  # noqa: E402
from omniinfer.models.layers.rotary import rope_tables  # noqa: E402
from omniinfer.quantization.gguf_file import GGUFError, GGUFFile  # noqa: E402
from omniinfer.testing.greedy import hf_greedy  # noqa: E402
from omniinfer.testing.tiny_models import build_tiny_checkpoint  # noqa: E402

# short enough an original context that the tiny model's positions meet every kind of frequency:
# wavelengths above 64 divided by 8, below 16 kept, those between smoothed
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
PROMPTS = [[1, 5, 9, 33, 7, 20], list(range(40, 100))]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama3")
    model = build_tiny_checkpoint(str(root / "m"), "llama", hidden_size=128, intermediate_size=256, vocab_size=400,
                                  rope_parameters=LLAMA3, seed=11)
    return model, gguf_export.export(model, str(root / "m-f32.gguf"), "f32")


def test_the_files_factors_are_the_llama3_frequencies(llama3):
    _, path = llama3
    cfg = GGUFFile(path).hf_config()
    scaling = cfg["rope_scaling"]
    assert scaling["rope_type"] == "freq_factors" and len(scaling["factors"]) == 16
    head = cfg["hidden_size"] // cfg["num_attention_heads"]
    cos, sin = rope_tables(head, 512, 10000.0, scaling)
    want_cos, want_sin = rope_tables(head, 512, 10000.0, LLAMA3)
    torch.testing.assert_close(cos, want_cos, atol=2e-5, rtol=0)
    torch.testing.assert_close(sin, want_sin, atol=2e-5, rtol=0)
    plain_cos, _ = rope_tables(head, 512, 10000.0, None)
    assert (cos - plain_cos).abs().max() > 0.5  # (the scaling changes the rotations: the check can fail)


def test_a_llama3_file_follows_transformers_on_its_checkpoint(llama3, monkeypatch):
    """The f32 file (the checkpoint's very weights) against transformers on the safetensors, whose
    config has the llama3 scaling; a 60-token prompt reaches past the scaled wavelengths."""
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    model, path = llama3
    llm = LLM(path, num_kv_blocks=64)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    want = hf_greedy(model, PROMPTS, 10)
    for out, (tokens, _) in zip(outs, want):
        assert list(out.outputs[0].token_ids) == tokens


def test_a_bad_rope_freqs_tensor_is_a_clear_error(llama3, tmp_path, monkeypatch):
    model, _ = llama3
    monkeypatch.setattr(gguf_export, "_llama3_factors", lambda cfg, heads: np.ones(5, dtype=np.float32))
    path = gguf_export.export(model, str(tmp_path / "bad.gguf"), "f32")
    with pytest.raises(GGUFError, match=r"'rope_freqs.weight' is F32 of shape \(5,\); expected F32 of shape "
                                        r"\(16,\), a factor for each rotary frequency"):
        GGUFFile(path).hf_config()
    monkeypatch.setattr(gguf_export, "_llama3_factors", lambda cfg, heads: np.array([1.0] * 15 + [0.0], np.float32))
    path = gguf_export.export(model, str(tmp_path / "zero.gguf"), "f32")
    with pytest.raises(GGUFError, match="its factors must be finite and positive"):
        LLM(path)
    assert os.path.getsize(path) > 0


def _with_rotary_dims(monkeypatch, dims: int) -> None:
    """The exporter writes `rope.dimension_count` for phi3 only (as llama.cpp's converter for
    these tiny models): add it, `dims`, to any file."""
    import gguf

    original = gguf.GGUFWriter.add_context_length

    def add(self, n):
        original(self, n)
        self.add_rope_dimension_count(dims)

    monkeypatch.setattr(gguf.GGUFWriter, "add_context_length", add)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rotary_dims_below_the_head_are_refused_where_llama_cpp_refuses_them(tmp_path, monkeypatch, arch):
    """llama.cpp turns the first n_rot features of each head in Phi-3 and Gemma files
    (tests/test_gguf_phi3.py); its llama and qwen2 graphs assert n_rot is the head size."""
    model = build_tiny_checkpoint(str(tmp_path / arch), arch, hidden_size=128, vocab_size=400, seed=2)
    _with_rotary_dims(monkeypatch, 24)  # (of 32)
    path = gguf_export.export(model, str(tmp_path / f"{arch}.gguf"), "f32")
    with pytest.raises(GGUFError, match=rf"{arch}.rope.dimension_count=24 turns part of each 32-wide head; a "
                                        rf"{arch} file turns whole heads \(llama.cpp's too; part of them: phi3, "
                                        r"gemma2, gemma3\)"):
        GGUFFile(path).hf_config()
