"""Detokenizers: the byte-level one's text equals the tokenizer's own decode however tokens are
grouped, the fallbacks keep the same contract, and the engine's text is the same streamed or not."""

from __future__ import annotations

import random

import pytest

from omniinfer import LLM, SamplingParams
from omniinfer.engine.detokenizer import (
    ByteLevelDetokenizer,
    Detokenizers,
    IncrementalDetokenizer,
    StreamDetokenizer,
    byte_level_table,
)
from omniinfer.testing.tiny_models import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_tokenizer()
    # added tokens beyond the trained ones: a special one, and plain ones whose text is outside
    # the byte alphabet (a space, accents, CJK) or inside it ("Ġ" stands for a space byte)
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    tok.add_tokens([" hello", "héllo", "语言", "ĠĠ"])
    return tok


def detokenize(tokenizer, ids, skip, sizes):
    """Text from a ByteLevelDetokenizer fed `ids` in groups of the given sizes, read after each."""
    d = Detokenizers(tokenizer)([], skip)
    assert isinstance(d, ByteLevelDetokenizer)
    text, i = "", 0
    for size in sizes:
        for t in ids[i:i + size]:
            d.push(t)
        text += d.take()
        i += size
    return text + d.flush()


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_text_is_the_tokenizers_decode_for_any_grouping(tokenizer, skip):
    backend = tokenizer._tokenizer
    vocab = backend.get_vocab_size(with_added_tokens=True)
    rng = random.Random(0)
    for _ in range(400):  # random ids: most are not valid UTF-8 on their own
        ids = [rng.randrange(vocab + 8) for _ in range(rng.randrange(0, 30))]  # some unknown ids
        expected = backend.decode(ids, skip_special_tokens=skip)
        one = detokenize(tokenizer, ids, skip, [1] * len(ids))
        whole = detokenize(tokenizer, ids, skip, [len(ids)])
        mixed = detokenize(tokenizer, ids, skip, [rng.randrange(1, 5) for _ in ids])
        assert one == whole == mixed == expected, ids


def test_added_and_special_tokens(tokenizer):
    ids = tokenizer.convert_tokens_to_ids(["<s>", " hello", "héllo", "<|tool|>", "语言", "ĠĠ", "</s>"])
    for skip in (True, False):
        text = detokenize(tokenizer, ids, skip, [1] * len(ids))
        assert text == tokenizer._tokenizer.decode(ids, skip_special_tokens=skip)
    assert "<|tool|>" not in detokenize(tokenizer, ids, True, [len(ids)])
    assert "<|tool|>" in detokenize(tokenizer, ids, False, [len(ids)])


def test_a_character_split_across_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer("é€", add_special_tokens=False).input_ids
    pieces = [tokenizer._tokenizer.decode([t]) for t in ids]
    assert len(ids) > 1 and any("\ufffd" in p for p in pieces), "need a character split by tokens"
    d = Detokenizers(tokenizer)([], True)
    texts = []
    for t in ids:
        d.push(t)
        texts.append(d.take())
    assert "".join(texts) + d.flush() == "é€"
    assert not any("\ufffd" in t for t in texts)
    d = Detokenizers(tokenizer)([], True)
    d.push(ids[0])
    assert d.take() == "" and d.flush() == "\ufffd"  # a lone lead byte at the end


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace decoder strips the first space): no byte table."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["</s>"],
                                                show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def test_other_decoders_get_the_token_by_token_detokenizers():
    tok = metaspace_tokenizer()
    assert byte_level_table(tok._tokenizer, True) is None
    prompt = tok("the quick").input_ids
    ids = tok(" brown fox jumps").input_ids
    d = Detokenizers(tok)(prompt, True)
    assert isinstance(d, StreamDetokenizer)
    added = "".join(d.add(t) for t in ids) + d.flush()
    for make in (lambda: Detokenizers(tok)(prompt, True), lambda: IncrementalDetokenizer(tok, prompt)):
        d = make()
        for t in ids[:2]:
            d.push(t)
        text = d.take()
        for t in ids[2:]:
            d.push(t)
        assert text + d.flush() == added  # push/take/flush give add's text
    assert added == " brown fox jumps"


def byte_fallback_tokenizer():
    """Llama 2's kind of tokenizer, built here: SentencePiece-style spaces (Metaspace) and the 256
    `<0xNN>` byte tokens in the vocabulary for what it has no token for (its decoder's
    ByteFallback turns a run of them into UTF-8, or into U+FFFD for each byte of an invalid run)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    letters = "\u2581abcdefghijklmnopqrstuvwxyzHLW"
    vocab.update({c: len(vocab) + i for i, c in enumerate(letters)})
    merges = [("\u2581", "H"), ("e", "l"), ("el", "l"), ("ell", "o")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_an_invalid_byte_run_does_not_fail_the_stream():
    """A byte token that read as ")" alone reads as U+FFFD once an invalid byte (a lead byte with
    no continuation) joins its run: tokenizers' DecodeStream then raised "Invalid prefix
    encountered", and the engine failed the request. The text given out stays; the rest goes on
    through IncrementalDetokenizer."""
    tok = byte_fallback_tokenizer()
    prompt = tok("Hello").input_ids
    ids = tok.convert_tokens_to_ids(["x", "<0x29>", "<0xC7>", "d", "\u2581", "o", "k"])
    d = Detokenizers(tok)(prompt, True)
    assert isinstance(d, StreamDetokenizer)
    texts = [d.add(t) for t in ids]
    assert texts[:3] == ["x", ")", ""] and d.fallback is not None  # (the lead byte waits)
    assert "".join(texts) + d.flush() == "x)\ufffdd ok"
    whole = tok.decode(prompt + ids)
    assert whole == "Hellox\ufffd\ufffdd ok"  # (decoded at once, the ")" is U+FFFD too)


def test_an_output_cut_inside_a_character_ends_with_its_replacement():
    """max_tokens ends the output inside a character: flush gives a U+FFFD for each of its bytes,
    as decoding the whole does. (It decoded the output alone, which a SentencePiece decoder's
    Strip shortens by its first space, and the last of them was lost.)"""
    tok = byte_fallback_tokenizer()
    prompt = tok("Hello").input_ids
    ids = tok.convert_tokens_to_ids(["\u2581", "o", "k", "<0xE2>", "<0x82>"])
    d = Detokenizers(tok)(prompt, True)
    assert "".join(d.add(t) for t in ids) == " ok" and d.flush() == "\ufffd\ufffd"
    assert tok.decode(prompt + ids) == "Hello ok\ufffd\ufffd"


def test_random_byte_tokens_stream_as_the_window_decoder_reads_them():
    """Random outputs after real prompts, 40% of them bytes: none fails, and the text is what
    IncrementalDetokenizer (decoding a window, holding back a trailing U+FFFD) gives, up to how
    many U+FFFD an invalid run shows (one a byte, or fewer, by where the windows cut the run);
    push/take/flush give add's text."""
    import re

    runs = re.compile("\ufffd+")
    tok = byte_fallback_tokenizer()
    backend = tok._tokenizer
    rng = random.Random(0)
    fell_back = 0
    for _ in range(300):
        prompt = tok(rng.choice(["Hello", "Hello world", "x\u20ac", "ok\n"])).input_ids
        ids = [rng.randrange(3, 259) if rng.random() < 0.4 else rng.randrange(259, len(tok)) for _ in range(10)]
        d = Detokenizers(tok)(prompt, True)
        text = "".join(d.add(t) for t in ids) + d.flush()
        fell_back += d.fallback is not None
        ref = IncrementalDetokenizer(backend, prompt)
        expected = "".join(ref.add(t) for t in ids) + ref.flush()
        assert runs.sub("\ufffd", text) == runs.sub("\ufffd", expected), (prompt, ids)
        pushed = Detokenizers(tok)(prompt, True)
        for t in ids[:4]:
            pushed.push(t)
        head = pushed.take()
        for t in ids[4:]:
            pushed.push(t)
        assert head + pushed.flush() == text
    assert 30 < fell_back < 270  # (both ways were taken)


def test_engine_text_streamed_or_not_and_with_stop_strings(checkpoint_dir):
    llm = LLM(checkpoint_dir("llama"), num_kv_blocks=96, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=64)
    assert isinstance(llm.llm_engine.output_processor.make_detokenizer([], True), ByteLevelDetokenizer)
    tok = llm.get_tokenizer()
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["The quick brown", "0123 é€ 语", "def main(argv):"]
    plain = llm.generate(prompts, params, use_tqdm=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, params, stream=True)
    chunks = {f"s{i}": [] for i in range(len(prompts))}
    seen = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            chunks[out.request_id].append(text[len(seen.get(out.request_id, "")):])
            assert text.startswith(seen.get(out.request_id, ""))  # text only grows
            seen[out.request_id] = text
    for i, out in enumerate(plain):
        c = out.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert "".join(chunks[f"s{i}"]) == c.text
        assert sum(1 for text in chunks[f"s{i}"] if text) >= 2  # text before the end, too
    # a stop string decodes token by token; the text before it is the same
    stop = plain[0].outputs[0].text[6:9]
    cut = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.text == plain[0].outputs[0].text[:plain[0].outputs[0].text.find(stop)]
