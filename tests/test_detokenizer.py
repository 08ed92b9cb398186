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
