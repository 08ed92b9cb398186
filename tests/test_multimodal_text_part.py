"""Gemma 3 4B / 12B / 27B ship as `Gemma3ForConditionalGeneration`, Mistral Small 3.1 / 3.2 as
`Mistral3ForConditionalGeneration` (a vision tower beside the language model): omniinfer
refused them ("architecture not supported"), though their text part is a model it runs. It now serves that part: greedy tokens as transformers' whole model
gives on text, whichever way the checkpoint names its weights, and from a config.json that
lists only what differs from the defaults (as the Hub's do)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from omniinfer import LLM, SamplingParams
from omniinfer.testing.tiny_models import FAMILY_SETTINGS, build_tokenizer

PROMPTS = [[2, 17, 33, 9, 101, 7], list(range(40, 70))]
TEXT = dict(FAMILY_SETTINGS["gemma3"], model_type="gemma3_text", vocab_size=384, hidden_size=64, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
            initializer_range=0.1)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8)


MISTRAL = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.1,
               sliding_window=None)
FAMILIES = {  # architecture -> (config class, its text_config, vision_config, extra settings)
    "Gemma3ForConditionalGeneration": ("Gemma3Config", dict(TEXT), VISION, dict(mm_tokens_per_image=4)),
    "Mistral3ForConditionalGeneration": ("Mistral3Config", dict(MISTRAL, model_type="mistral"),
                                         dict(VISION, model_type="pixtral", head_dim=16), dict(spatial_merge_size=2)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    import transformers

    arch = request.param
    config_cls, text, vision, extra = FAMILIES[arch]
    path = str(tmp_path_factory.mktemp("mm") / arch)
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(text_config=text, vision_config=vision, **extra)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():  # (transformers' init gives every norm the same weight)
        for name, p in model.named_parameters():
            if "norm" in name and "language_model" in name:
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    with torch.no_grad():
        reference = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                     for p in PROMPTS]
    return path, arch, reference


def greedy(path: str, arch: str) -> list[list[int]]:
    llm = LLM(path, num_kv_blocks=64, block_size=8)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert llm.llm_engine.config.model.text_part_of == arch
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def test_the_text_part_decodes_as_transformers_whole_model(checkpoint):
    path, arch, reference = checkpoint
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == [arch]
    assert greedy(path, arch) == reference


def test_older_weight_names_and_a_sparse_config(checkpoint, tmp_path):
    """transformers 4.5x wrote language_model.model.X and vision_tower.X (the Hub's Gemma 3
    files); the Hub's config.json gives text_config only its non-default values."""
    import shutil

    path, arch, reference = checkpoint
    old = str(tmp_path / "old")
    shutil.copytree(path, old)
    file = os.path.join(old, "model.safetensors")
    renames = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector."))
    tensors = {}
    for name, t in load_file(file).items():
        for a, b in renames:
            if name.startswith(a):
                name = b + name[len(a):]
                break
        tensors[name] = t
    assert any(n.startswith("language_model.model.") for n in tensors)
    save_file(tensors, file, metadata={"format": "pt"})
    config_file = os.path.join(old, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["text_config"] = FAMILIES[arch][1]  # (what was set; defaults left out)
    with open(config_file, "w") as f:
        json.dump(config, f)
    assert greedy(old, arch) == reference


def test_a_checkpoint_without_a_text_config_is_named(checkpoint, tmp_path):
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(checkpoint[0], bad)
    config_file = os.path.join(bad, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    del config["text_config"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=f"{checkpoint[1]} has no 'text_config'"):
        LLM(bad)
