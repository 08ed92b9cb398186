"""A checkpoint whose tokenizer is only a SentencePiece `tokenizer.model` (Vicuna, older
Llama 2 fine-tunes: no tokenizer.json). transformers converts it with the sentencepiece and
protobuf packages; without them loading failed with "Error parsing line b'\\x0e'". The model
file is trained here by sentencepiece's own trainer, and its own encoder is the reference."""

from __future__ import annotations

import json
import os
import re

import pytest

from omniinfer import LLM, SamplingParams
from omniinfer.testing.tiny_models import build_tiny_checkpoint

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Return the number of items in the list.",
         "def main():\n    print('hello world')", "naïve café, 日本語のテキスト 😀"]


@pytest.fixture(scope="module")
def spm_checkpoint(tmp_path_factory):
    import sentencepiece as spm

    root = tmp_path_factory.mktemp("spm")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 50), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(root / "tok"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2,
                                   # Llama 2's settings: text as given (no NFKC, spaces kept)
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   split_digits=True)
    processor = spm.SentencePieceProcessor(model_file=str(root / "tok.model"))
    path = build_tiny_checkpoint(str(root / "model"), "llama", vocab_size=processor.get_piece_size())
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(os.path.join(path, name))
    os.replace(root / "tok.model", os.path.join(path, "tokenizer.model"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False, "legacy": False}, f)
    config_file = os.path.join(path, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(bos_token_id=1, eos_token_id=2, pad_token_id=None)
    with open(config_file, "w") as f:
        json.dump(config, f)
    return path, processor


def test_a_tokenizer_model_alone_loads_and_encodes_as_sentencepiece(spm_checkpoint, hf_greedy):
    path, processor = spm_checkpoint
    assert "tokenizer.json" not in os.listdir(path)
    llm = LLM(path, num_kv_blocks=32, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate(TEXTS, params, use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        assert out.prompt_token_ids == [1] + processor.encode(text)  # (add_bos_token)
        assert out.outputs[0].token_ids == hf_greedy(path, out.prompt_token_ids, 8)
        # (a random model writes stray bytes: each decoder marks an invalid run with U+FFFD, in
        # its own count)
        assert collapsed(out.outputs[0].text) == collapsed(processor.decode(out.outputs[0].token_ids))


def collapsed(text: str) -> str:
    return re.sub("\ufffd+", "\ufffd", text)
