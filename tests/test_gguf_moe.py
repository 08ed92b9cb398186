"""Mixture-of-experts GGUF files (qwen3moe, qwen2moe with its shared expert, Mixtral as a llama file
with experts), written as llama.cpp's converter writes them: each layer's experts stacked into one
tensor per projection, the router in float32.

References: transformers on the checkpoint the file came from (the f32 file: names, routing and
the config read back), and transformers on the weights the `gguf` package dequantises from the
file (the quantised files: what the kernels compute; transformers reads no routing rule from a
GGUF file, and llama.cpp's are the file's meaning: Qwen3-MoE renormalises, Qwen2-MoE does not).
Float activations give the reference's tokens; int8 activations (the default) follow it up to a
near-tie (omniinfer.testing.greedy)."""

from __future__ import annotations

import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch

from omniinfer import LLM, SamplingParams
from omniinfer.benchmarks.gguf_export import export
from omniinfer.quantization.gguf_file import GGUFError, GGUFFile
from omniinfer.testing.greedy import agreed_steps, dequantized_checkpoint, hf_greedy, kernel_names
from omniinfer.testing.tiny_models import build_tiny_checkpoint

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7, 20], list(range(40, 90))]
COMMON = dict(hidden_size=256, intermediate_size=256, seed=2)
FAMILIES = {  # 8 experts, 2 a token; qwen3's experts 256 wide (K-quant blocks in down's rows too)
    "qwen3_moe": dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {arch: build_tiny_checkpoint(str(root / arch), arch, **COMMON, **kw) for arch, kw in FAMILIES.items()}


def gguf_of(models, arch: str, file_type: str) -> str:
    path = os.path.join(models[arch], f"{file_type}.gguf")
    return path if os.path.isfile(path) else export(models[arch], path, file_type)


def generate(path: str, tokenizer: str, **kw) -> list[list[int]]:
    llm = LLM(path, tokenizer=tokenizer, num_kv_blocks=64, **kw)
    try:
        return [list(o.outputs[0].token_ids) for o in
                llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_an_f32_moe_file_runs_as_its_checkpoint_in_transformers(models, arch):
    path = gguf_of(models, arch, "f32")
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight", "blk.0.ffn_gate_inp.weight"} <= names
    assert ("blk.0.ffn_gate_shexp.weight" in names) == (arch == "qwen2_moe")
    assert generate(path, models[arch]) == [tokens for tokens, _ in hf_greedy(models[arch], PROMPTS, PARAMS.max_tokens)]


@pytest.mark.parametrize("arch,file_type", [("qwen3_moe", "q4_k_m"), ("qwen3_moe", "q8_0"),
                                            ("qwen2_moe", "q4_k_m"), ("mixtral", "q4_0")])
def test_quantised_experts_compute_the_files_weights(models, arch, file_type, monkeypatch, tmp_path):
    path = gguf_of(models, arch, file_type)
    want = hf_greedy(dequantized_checkpoint(path, models[arch], str(tmp_path / "ref")), PROMPTS, PARAMS.max_tokens)
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    assert generate(path, models[arch]) == [tokens for tokens, _ in want]
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "int8")
    for tokens, (_, steps) in zip(generate(path, models[arch]), want):
        agreed_steps(tokens, steps)


@pytest.mark.parametrize("arch,name", [("qwen3_moe", "IQ3_S"), ("qwen3_moe", "IQ1_M"), ("mixtral", "IQ2_XXS")])
def test_lattice_experts_compute_the_files_weights(models, arch, name, monkeypatch, tmp_path):
    """llama.cpp's IQ1/IQ2/IQ3 experts (random lattice blocks at the checkpoint's scale), each
    expert rewritten at load as Q6_K or Q8_0 (gguf_transcode.py) on the experts' kernels."""
    from omniinfer.testing import kquant

    monkeypatch.setitem(kquant.QUANTIZERS, name, kquant.lattice_noise(name, seed=3))
    path = export(models[arch], str(tmp_path / f"{name}.gguf"), name.lower())
    assert gguf.GGUFReader(path).get_tensor(2).tensor_type.name in (name, "F32", "Q6_K")
    want = hf_greedy(dequantized_checkpoint(path, models[arch], str(tmp_path / "ref")), PROMPTS, PARAMS.max_tokens)
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    got = generate(path, models[arch])
    if name == "IQ2_XXS":  # (its scales rounded to float16: up to a near-tie)
        for tokens, (_, steps) in zip(got, want):
            agreed_steps(tokens, steps)
    else:
        assert got == [tokens for tokens, _ in want]
    # int8 activations: the first token up to a near-tie. (After it, a 1-3-bit random model's
    # near-flat logits and the router's top-2 of 8 amplify the rounding: its Q2_K file, on its own
    # kernels, parts from the float run at the second token too.)
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "int8")
    for tokens, (_, steps) in zip(generate(path, models[arch]), want):
        agreed_steps(tokens[:1], steps[:1])


def test_experts_are_held_as_the_files_bytes(models):
    """No float copy: the stacked expert parameters stay on the meta device, each expert's gate/up
    and down are the file's blocks run by the CPU kernels, and the model holds the file's bytes."""
    path = gguf_of(models, "qwen3_moe", "q4_k_m")
    llm = LLM(path, tokenizer=models["qwen3_moe"], num_kv_blocks=64)
    try:
        runner = llm.llm_engine.executor.worker.model_runner
        experts = runner.model.model.layers["1"].mlp.experts
        assert experts.w13_weight.is_meta and experts.w2_weight.is_meta
        assert experts.moe_method.name == "quantised experts"
        assert experts.moe_method.step is not None  # (the CPU plugin's one-call step for a token's experts)
        w13, w2 = experts.qexperts.w13, experts.qexperts.w2
        assert len(w13) == len(w2) == 8
        # (the file's kinds, held repacked in the CPU kernels' groups of 8 rows; down in Q6_K in
        # the last layer: llama.cpp's more_bits)
        assert [c[0] for c in w13[3].quant_choices + w2[3].quant_choices] == ["gguf:Q4_K", "gguf:Q6_K"]
        assert w13[3].qweight.kinds == ["cpu:Q4_Kx8"] and w2[3].qweight.kinds == ["cpu:Q6_Kx8"]
        assert {k for _, k, _ in experts.quant_choices} == kernel_names(llm)
        assert all(k.startswith("cpu") for k in kernel_names(llm))
        file_bytes = sum(GGUFFile(path).tensor_bytes().values())
        assert 0.95 * file_bytes < runner.model_bytes() < 1.05 * file_bytes
    finally:
        llm.shutdown()


def test_moe_gguf_under_tensor_parallelism(models):
    """Each rank takes its half of every expert's gate/up rows and down columns (Q8_0's blocks of
    32: 64 / 2 columns a rank), and of the shared expert's (128 / 2)."""
    path = gguf_of(models, "qwen2_moe", "q8_0")
    assert generate(path, models["qwen2_moe"], tensor_parallel_size=2) == generate(path, models["qwen2_moe"])


def test_bad_expert_metadata_is_named(models, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(models["qwen3_moe"], bad)
    with open(bad / "config.json") as f:
        cfg = json.load(f)
    cfg["num_experts_per_tok"] = 9
    with open(bad / "config.json", "w") as f:
        json.dump(cfg, f)
    path = export(str(bad), str(tmp_path / "used.gguf"), "q8_0")
    with pytest.raises(GGUFError, match=r"used.gguf: metadata key 'qwen3moe.expert_used_count' is 9, more than "
                                         r"qwen3moe.expert_count=8"):
        LLM(path, tokenizer=models["qwen3_moe"])

    writer = gguf.GGUFWriter(str(tmp_path / "flat.gguf"), "qwen3moe")
    for key, value in dict(embedding_length=256, block_count=1, head_count=4, expert_count=8,
                           expert_used_count=2, expert_feed_forward_length=64).items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((16, 256), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((512, 256), dtype=np.float32))  # (not stacked)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"tensor 'blk.0.ffn_gate_exps.weight' of shape \(512, 256\): experts are "
                                         r"read as \[experts, rows, cols\] stacks"):
        list(GGUFFile(str(tmp_path / "flat.gguf")).named_tensors())


def test_the_reference_moe_path_is_the_same_sum_at_batch_one():
    """routed_sum's batch-1 path (no masks) adds the same terms as its general one (in the same order:
    what is left is the products' own rounding, one row against three)."""
    from omniinfer.models.layers.moe import reference_moe

    torch.manual_seed(0)
    w13, w2 = torch.randn(6, 32, 16), torch.randn(6, 16, 16)
    x = torch.randn(3, 16)
    weights, ids = torch.rand(3, 2), torch.tensor([[4, 1], [0, 4], [5, 2]])
    batch = reference_moe(x, w13, w2, weights, ids)
    for t in range(3):
        torch.testing.assert_close(reference_moe(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1]),
                                   batch[t:t + 1], rtol=1e-6, atol=1e-4)


def _rewrite(path: str, out: str, tensors) -> str:
    """`path`'s metadata with the tensors `tensors(reader)` yields ((name, array, raw type or None))."""
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), field.types[0], sub)
    for name, data, raw in tensors(reader):
        writer.add_tensor(name, data, raw_dtype=raw) if raw is None else \
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_a_first_converter_mixtral_file_with_a_tensor_per_expert(models, tmp_path):
    """llama.cpp's first Mixtral files: `blk.N.ffn_gate.E.weight`, one tensor an expert."""
    def split(reader):
        for t in reader.tensors:
            stack = next((s for s in ("ffn_gate", "ffn_up", "ffn_down") if t.name.endswith(f".{s}_exps.weight")), None)
            data = np.asarray(t.data)
            if stack is None:
                yield t.name, data, None
                continue
            for e in range(data.shape[0]):
                yield t.name.replace(f"{stack}_exps", f"{stack}.{e}"), np.ascontiguousarray(data[e]), None

    path = _rewrite(gguf_of(models, "mixtral", "f32"), str(tmp_path / "split.gguf"), split)
    assert "blk.0.ffn_gate.3.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    assert generate(path, models["mixtral"]) == generate(gguf_of(models, "mixtral", "f32"), models["mixtral"])


def test_a_layer_without_a_router_is_a_dense_mlp(tmp_path):
    """A Qwen2-MoE whose layer 1 is dense (`mlp_only_layers`): its file has ffn_gate / ffn_up /
    ffn_down there and no router, read back as that layer's MLP of `feed_forward_length`."""
    ckpt = build_tiny_checkpoint(str(tmp_path / "ck"), "qwen2_moe", **COMMON, **FAMILIES["qwen2_moe"],
                                 mlp_only_layers=[1])
    path = export(ckpt, str(tmp_path / "f32.gguf"), "f32")
    cfg = GGUFFile(path).hf_config()
    assert cfg["mlp_only_layers"] == [1] and cfg["intermediate_size"] == COMMON["intermediate_size"]
    assert generate(path, ckpt) == [tokens for tokens, _ in hf_greedy(ckpt, PROMPTS, PARAMS.max_tokens)]


def test_a_qwen_moe_files_tokenizer_is_a_qwen_files(models, tmp_path):
    """No --tokenizer: a Qwen-MoE file's tokenizer is of the class a dense Qwen file's is (found by
    its model type: Qwen2's; AutoTokenizer gives such a file a generic class, which encodes digits
    other than llama.cpp does), encoding the same (and as llama.cpp: tests/test_gguf_llama_cpp.py)."""
    from omniinfer.quantization.gguf_tokenizer import load_tokenizer

    text = "Blocks of tokens are shared by reference count: 0123 + 45 = ?"
    dense = build_tiny_checkpoint(str(tmp_path / "qwen3"), "qwen3", seed=1)
    want = load_tokenizer(export(dense, str(tmp_path / "dense.gguf"), "q8_0"))
    got = load_tokenizer(gguf_of(models, "qwen3_moe", "q8_0"))
    assert type(got) is type(want) and type(got).__name__ == "Qwen2Tokenizer"
    assert got.encode(text) == want.encode(text)
