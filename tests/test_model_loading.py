"""Checkpoint loading: sharded files, and clear errors naming the file and the tensor."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniinfer import LLM


def greedy(n: int):
    from omniinfer import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def copy_checkpoint(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def edit_config(path: str, change) -> str:
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    change(config)
    with open(config_file, "w") as f:
        json.dump(config, f)
    return config_file


def rewrite_weights(path: str, change) -> None:
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_sharded_checkpoint_loads(checkpoint_dir):
    path = checkpoint_dir("llama_sharded")
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    LLM(path, num_kv_blocks=8)


def test_missing_tensor_names_it(checkpoint_dir, tmp_path):
    path = copy_checkpoint(checkpoint_dir("llama"), tmp_path / "m")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError) as info:
        LLM(path, num_kv_blocks=8)
    assert "'model.layers.1.mlp.up_proj.weight'" in str(info.value) and path in str(info.value)


def test_shape_mismatch_names_file_and_tensor(checkpoint_dir, tmp_path):
    path = copy_checkpoint(checkpoint_dir("llama"), tmp_path / "m")

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)

    rewrite_weights(path, shrink)
    with pytest.raises(ValueError) as info:
        LLM(path, num_kv_blocks=8)
    message = str(info.value)
    assert "'model.layers.0.self_attn.k_proj.weight'" in message
    assert "model.safetensors" in message and "shape" in message


def test_unknown_architecture(checkpoint_dir, tmp_path):
    path = copy_checkpoint(checkpoint_dir("llama"), tmp_path / "m")
    config_file = edit_config(path, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError) as info:
        LLM(path, num_kv_blocks=8)
    message = str(info.value)
    assert "'GPT2LMHeadModel'" in message and "LlamaForCausalLM" in message and config_file in message


def test_no_weights(checkpoint_dir, tmp_path):
    path = copy_checkpoint(checkpoint_dir("llama"), tmp_path / "m")
    os.remove(os.path.join(path, "model.safetensors"))
    torch.save({"step": torch.tensor(1)}, os.path.join(path, "training_args.bin"))  # (not weights)
    with pytest.raises(ValueError, match=r"no weights in .*: expected \*.safetensors or pytorch_model\*.bin"):
        LLM(path, num_kv_blocks=8)


def as_bin_checkpoint(src: str, dst, num_shards: int) -> str:
    """The checkpoint with its weights as PyTorch .bin files, as transformers 4 saved them
    (`pytorch_model.bin`, or shards and `pytorch_model.bin.index.json`)."""
    path = copy_checkpoint(src, dst)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    if num_shards == 1:
        torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
        return path
    names, weight_map = sorted(tensors), {}
    for i in range(num_shards):
        file = f"pytorch_model-{i + 1:05d}-of-{num_shards:05d}.bin"
        part = {n: tensors[n] for n in names[i::num_shards]}
        torch.save(part, os.path.join(path, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


@pytest.mark.parametrize("num_shards", [1, 3])
def test_pytorch_bin_checkpoints_load(num_shards, checkpoint_dir, tmp_path, hf_greedy):
    """Older Hugging Face checkpoints ship only .bin weights; transformers loads them, and so
    does omniinfer (it said 'convert them to safetensors')."""
    path = as_bin_checkpoint(checkpoint_dir("llama"), tmp_path / "m", num_shards)
    prompt = [5, 17, 33, 9, 101]
    out = LLM(path, num_kv_blocks=16).generate({"prompt_token_ids": prompt}, greedy(12), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(path, prompt, 12)  # (transformers reads the .bin)


def test_a_bin_file_that_would_run_code_is_refused(checkpoint_dir, tmp_path):
    path = as_bin_checkpoint(checkpoint_dir("llama"), tmp_path / "m", 1)
    marker = tmp_path / "ran"
    state = torch.load(os.path.join(path, "pytorch_model.bin"), weights_only=True)
    state["evil"] = Exploit(str(marker))
    torch.save(state, os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(ValueError, match=r"pytorch_model.bin could not be read as PyTorch weights "
                                         r"\(weights_only: tensors only, no code\)"):
        LLM(path, num_kv_blocks=8)
    assert not marker.exists()


def test_a_bin_shape_mismatch_names_the_file(checkpoint_dir, tmp_path):
    path = as_bin_checkpoint(checkpoint_dir("llama"), tmp_path / "m", 3)
    with open(os.path.join(path, "pytorch_model.bin.index.json")) as f:
        index = json.load(f)
    name = "model.layers.0.self_attn.k_proj.weight"
    file = os.path.join(path, index["weight_map"][name])
    state = torch.load(file, weights_only=True)
    state[name] = torch.zeros(8, 64)
    torch.save(state, file)
    with pytest.raises(ValueError, match=rf"tensor '{name}' in {file} has the wrong shape"):
        LLM(path, num_kv_blocks=8)


class Exploit:
    """A pickle that creates a file when loaded without weights_only."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("scaling,message", [
    ({"type": "mrope", "factor": 2.0}, "rope scaling type 'mrope' is not supported; supported: default"),
    ({"type": "yarn", "factor": 2.0}, "rope scaling 'yarn' needs 'original_max_position_embeddings'"),
])
def test_unsupported_rope_scaling(scaling, message, checkpoint_dir, tmp_path):
    path = copy_checkpoint(checkpoint_dir("llama"), tmp_path / "m")

    def edit(config):
        config.pop("rope_parameters", None)
        config["rope_scaling"] = scaling

    edit_config(path, edit)
    with pytest.raises(ValueError, match=message):
        LLM(path, num_kv_blocks=8)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("num_attention_heads"), r"config.json has no 'num_attention_heads'"),
    (lambda c: c.update(num_attention_heads=0), r"num_attention_heads=0 in \S+config.json is not allowed; it "
                                                r"must be a positive integer"),
    (lambda c: c.update(hidden_size="64"), r"hidden_size='64' in \S+ is not allowed; it must be a positive"),
    (lambda c: c.update(vocab_size=True), r"vocab_size=True in \S+ is not allowed"),
    (lambda c: c.update(max_position_embeddings=-1), r"max_position_embeddings=-1 in \S+ is not allowed"),
])
def test_a_config_with_impossible_sizes_is_named(change, message, checkpoint_dir, tmp_path):
    path = copy_checkpoint(checkpoint_dir("llama"), tmp_path / "m")
    edit_config(path, change)
    with pytest.raises(ValueError, match=message):
        LLM(path, num_kv_blocks=8)


def test_transformers4_style_config(checkpoint_dir, tmp_path, hf_greedy):
    """config.json written by transformers 4 (rope_theta/rope_scaling, torch_dtype) loads too."""
    path = copy_checkpoint(checkpoint_dir("llama3_rope"), tmp_path / "m")

    def old_style(config):
        params = config.pop("rope_parameters")
        config["rope_theta"] = params.pop("rope_theta")
        config["rope_scaling"] = params
        config["torch_dtype"] = config.pop("dtype", "float32")

    edit_config(path, old_style)
    from omniinfer import SamplingParams

    out = LLM(path, num_kv_blocks=16).generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(checkpoint_dir("llama3_rope"), [5, 6, 7, 8], 8)
