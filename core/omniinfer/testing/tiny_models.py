"""Tiny randomly initialised Llama-family checkpoints with a real tokenizer, built offline.

`initializer_range` defaults to 0.1: at transformers' 0.02 a tiny model is nearly blind to
position, and position or KV-cache bugs would go unnoticed.
"""

from __future__ import annotations

import json
import os

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Return the number of items in a container. "
    "This module provides functions for working with paths, files and directories. "
    "def main(argv): parse the arguments and print the result. A cache maps keys to values; "
    "blocks of tokens are shared by reference count and freed when no one holds them. "
    "0123456789 + - * / = ( ) [ ] { } < > , . ; : ! ? ' \" # @ $ % ^ & _ | ~ `"
)

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
# what each family needs beyond the shared tiny shape (Gemma's default head_dim is 256)
FAMILY_SETTINGS = {
    "qwen3": dict(head_dim=16),
    "gemma2": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8, num_hidden_layers=3,
                   tie_word_embeddings=True,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 1000000.0}}),
    "phi3": dict(original_max_position_embeddings=64, sliding_window=None, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(8)],
        "long_factor": [1.5 + 0.2 * i for i in range(8)]}),
}


def build_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a small built-in text, as transformers' fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def build_sentencepiece_tokenizer(vocab_size: int = 384):
    """A tokenizer of Llama 2's kind (what its tokenizer.json holds): SentencePiece-style spaces
    ("▁", a space before the first word), BPE pieces trained on the built-in text, and the 256
    `<0xNN>` byte tokens in the vocabulary for what no piece covers (ids 3-258 after <unk>, <s>,
    </s>, as Llama 2's), decoded by ByteFallback; a prompt starts with <s>."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def spaces():  # a space before the text, every space as "\u2581" (Llama 2's normalizer)
        return normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])

    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE())
    trained.normalizer = spaces()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=specials, show_progress=False)
    trained.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = {token: i for i, token in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = spaces()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def build_tiny_checkpoint(path: str, arch: str = "llama", *, dtype: str = "float32",
                          max_shard_size: str | None = None, seed: int = 0, norm_jitter: float = 0.0,
                          tokenizer: str = "byte-level", **overrides) -> str:
    """Write a tiny model of `arch` (a key of ARCHITECTURES) and its tokenizer to `path`.
    `norm_jitter`: the norms' weights 1 + norm_jitter * N(0, 1), not transformers' ones (every
    norm alike cannot tell one norm's weight from another's). `tokenizer`: "byte-level" (GPT-2's
    kind, `build_tokenizer`) or "sentencepiece" (Llama 2's, `build_sentencepiece_tokenizer`)."""
    import torch
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in ARCHITECTURES[arch])
    builders = {"byte-level": build_tokenizer, "sentencepiece": build_sentencepiece_tokenizer}
    if tokenizer not in builders:
        raise ValueError(f"tokenizer={tokenizer!r}: expected one of {sorted(builders)}")
    tokenizer = builders[tokenizer]()
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.1, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "mistral":
        settings["sliding_window"] = None
    settings.update(FAMILY_SETTINGS.get(arch, {}))
    settings.update(overrides)
    config = config_cls(**settings)
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype)).eval()
    if norm_jitter:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + norm_jitter * torch.randn(p.shape))
    os.makedirs(path, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    tokenizer.save_pretrained(path)
    return path
