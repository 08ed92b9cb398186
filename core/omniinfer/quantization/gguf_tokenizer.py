"""The tokenizer of a GGUF file: the class transformers builds from the file's vocabulary, held to
the file's special tokens and llama.cpp's BOS / EOS rules."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from omniinfer.logger import init_logger
from omniinfer.quantization.gguf_file import _MODEL_TYPES, GGUFFile

logger = init_logger(__name__)


def load_tokenizer(path: str):
    """The tokenizer transformers builds from a GGUF file's vocabulary and chat template: the class
    AutoTokenizer picks for the file's architecture, built by that class from the file.
    (AutoTokenizer itself first parses the whole file with `gguf.GGUFReader` to learn the
    architecture, for llama and qwen2 files: 13 s and ~45 MB left in the heap for a 152k-token
    vocabulary; the class reads only the vocabulary and merges. For a llama file transformers 5
    maps no class, and AutoTokenizer then took 9 s and grew the process by 101 MB, importing ~900
    modules (accelerate's among them), before building the TokenizersBackend built here directly
    in 0.6 s and 30 MB. tests/test_gguf_header.py checks both give the same tokenizer.)"""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    file = GGUFFile(path)
    # by the architecture's name: importing its config class (AutoConfig.for_model) imports
    # transformers' modelling code with it, ~860 modules and 64 MB for llama
    name = TOKENIZER_MAPPING_NAMES.get(file.arch) or TOKENIZER_MAPPING_NAMES.get(_MODEL_TYPES.get(file.arch))
    if isinstance(name, tuple):  # transformers 4: (slow, fast)
        name = name[1] or name[0]
    cls = tokenizer_class_from_name(name) if name else None
    if cls is None:  # (llama: transformers 5 maps no class; AutoTokenizer ends at TokenizersBackend)
        with contextlib.suppress(ImportError):
            from transformers import TokenizersBackend as cls
    tokenizer = (cls or AutoTokenizer).from_pretrained(os.path.dirname(os.path.abspath(file.path)),
                                                       gguf_file=os.path.basename(file.path))  # (a split's first)
    template = _chat_templates(file)
    if template and (isinstance(template, dict) or not getattr(tokenizer, "chat_template", None)):
        tokenizer.chat_template = template
    _follow_the_files_special_tokens(tokenizer, file)
    _follow_the_files_space_prefix(tokenizer, file)
    return tokenizer


def _chat_templates(file: GGUFFile) -> str | dict | None:
    """The file's chat template; with named ones too (llama.cpp's converter writes a checkpoint's
    "tool_use", "rag", ... as `tokenizer.chat_template.<name>`, listed in
    `tokenizer.chat_templates`), all of them by name, as transformers holds them ("default" the
    unnamed one): it picks "tool_use" when a request has tools."""
    default = file.field("tokenizer.chat_template")
    if file.field("tokenizer.chat_templates") is None:
        return default
    templates = {"default": default} if default else {}
    for name in file.header.strings("tokenizer.chat_templates"):
        text = file.field(f"tokenizer.chat_template.{name}")
        if isinstance(text, str):
            templates[name] = text
    return templates or None


def _follow_the_files_space_prefix(tokenizer, file: GGUFFile) -> None:
    """A SentencePiece vocabulary ("llama": Llama 2's, Mistral's) puts a space before the text and
    after each special token, as llama.cpp does (`add_space_prefix`, its default for these
    vocabularies: llama-vocab.cpp's `is_prev_special`) and as Llama 2's own tokenizer.json does (a
    Prepend normalizer, run on each piece of text between special tokens). transformers' class
    for such files pre-tokenizes with Metaspace(prepend_scheme="first"): once at the start, and
    not before text that starts with a space, so " hi" became "▁hi" where llama.cpp makes
    "▁▁hi", and "a</s>b" lost the space before "b". Files whose tokenizer transformers
    builds otherwise (Gemma's, Phi-3's) are left as they are."""
    from tokenizers import normalizers, pre_tokenizers

    if file.field("tokenizer.ggml.model") != "llama":
        return
    backend = tokenizer.backend_tokenizer
    if not isinstance(backend.pre_tokenizer, pre_tokenizers.Metaspace) or backend.normalizer is not None:
        return
    if file.field("tokenizer.ggml.add_space_prefix", True):
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")])
        backend.pre_tokenizer = None
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never",
                                                         split=False)


# llama.cpp's byte-level pre-tokenizers that add a BOS unless the file says otherwise (llama-vocab.cpp)
_BOS_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
            "jina-v5-nano", "tekken", "chameleon")
_SPECIAL = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"))


def _follow_the_files_special_tokens(tokenizer, file: GGUFFile) -> None:
    """The file's special tokens, and whether a prompt starts with BOS (ends with EOS), as llama.cpp
    reads them: `tokenizer.ggml.add_bos_token` / `add_eos_token`, else its default for the vocabulary
    (a sentencepiece one adds BOS; a byte-level one adds it for Llama 3's pre-tokenizer and a few
    others, _BOS_PRE). The class transformers picks by architecture does not always: for llama and
    phi3 files (TokenizersBackend) it left bos_token/eos_token unset, so a Llama 3 file's chat
    template rendered no <|begin_of_text|>, and a completion prompt had no BOS."""
    kind = file.field("tokenizer.ggml.model")
    if kind not in ("llama", "gpt2"):
        return  # (other vocabularies: as transformers builds them)
    vocab_size = len(tokenizer)
    ids = {}
    for name, key in _SPECIAL:
        value = file.field(f"tokenizer.ggml.{key}")
        if isinstance(value, (int, np.integer)) and 0 <= int(value) < vocab_size:
            ids[name] = int(value)
            if getattr(tokenizer, name, None) is None:
                setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(int(value)))
    add_bos = file.field("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = kind == "llama" or file.field("tokenizer.ggml.pre") in _BOS_PRE
    add_eos = bool(file.field("tokenizer.ggml.add_eos_token", False))
    want = ([ids["bos_token"]] if add_bos and "bos_token" in ids else []) + [None] + \
        ([ids["eos_token"]] if add_eos and "eos_token" in ids else [])
    if _specials_around(tokenizer, ids) == want:
        return
    from tokenizers.processors import TemplateProcessing

    names = {i: tokenizer.convert_ids_to_tokens(i) for i in want if i is not None}
    single = [names[i] if i is not None else "$A" for i in want]
    pair = single + [names[i] if i is not None else "$B:1" for i in want]
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=single, pair=pair, special_tokens=list((t, i) for i, t in names.items()))
    got = _specials_around(tokenizer, ids)
    if got != want:  # (served anyway: the prompts' special tokens are then transformers')
        logger.warning("%s: the tokenizer built from it puts %s around a prompt, not the %s the file asks "
                       "for (None: the prompt)", file.path, got, want)


def _specials_around(tokenizer, ids: dict) -> list:
    """The BOS / EOS ids the tokenizer puts around a prompt, with None for the prompt."""
    encoded = tokenizer.encode("a")
    bos, eos = ids.get("bos_token"), ids.get("eos_token")
    head = encoded[:1] if bos is not None and encoded[:1] == [bos] and len(encoded) > 1 else []
    tail = encoded[-1:] if eos is not None and encoded[-1:] == [eos] and len(encoded) > len(head) + 1 else []
    return head + [None] + tail
