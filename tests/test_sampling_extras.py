"""vLLM's SamplingParams extras: allowed_token_ids, bad_words, truncate_prompt_tokens and
detokenize, offline and through the server. Greedy choices are checked against transformers'
logits of the same tokens: the allowed (or not banned) token with the highest logit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from omniinfer import LLM, SamplingParams
from omniinfer.engine.request_checks import bad_words_token_ids

PROMPT = "Return the number of items"
GREEDY = dict(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def path(checkpoint_dir):
    return checkpoint_dir("llama")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, num_kv_blocks=64, block_size=8, max_num_seqs=8, max_model_len=64)


def run(llm, prompt=PROMPT, **kwargs):
    return llm.generate(prompt, SamplingParams(**{**GREEDY, **kwargs}), use_tqdm=False)[0]


def best_allowed(hf_logprobs, path, out, allowed_at) -> list[int]:
    """Transformers' greedy choice at each output position among `allowed_at(position, history)`."""
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    scores = hf_logprobs(path, ids)
    start = len(out.prompt_token_ids)
    picks = []
    for j in range(len(out.outputs[0].token_ids)):
        allowed = torch.tensor(allowed_at(j, out.outputs[0].token_ids[:j]))
        picks.append(int(allowed[scores[start + j - 1, allowed].argmax()]))
    return picks


def test_allowed_token_ids_are_the_only_ones_sampled(llm, path, hf_logprobs):
    plain = run(llm).outputs[0].token_ids
    allowed = sorted({plain[3], plain[5], 40, 41, 200})
    out = run(llm, allowed_token_ids=allowed)
    got = out.outputs[0].token_ids
    assert set(got) <= set(allowed) and got != plain
    assert got == best_allowed(hf_logprobs, path, out, lambda j, history: allowed)
    sampled = llm.generate(PROMPT, SamplingParams(temperature=1.5, n=4, seed=3, max_tokens=16,
                                                  ignore_eos=True, allowed_token_ids=allowed), use_tqdm=False)[0]
    assert all(set(c.token_ids) <= set(allowed) for c in sampled.outputs)
    # log-probs stay the raw model's, as vLLM's: the allowed set does not renormalise them
    with_lp = run(llm, allowed_token_ids=allowed, logprobs=0).outputs[0]
    raw = hf_logprobs(path, out.prompt_token_ids + got)
    first = len(out.prompt_token_ids) - 1
    assert [lp[t].logprob for lp, t in zip(with_lp.logprobs, got)] == pytest.approx(
        [float(raw[first + j, t]) for j, t in enumerate(got)], abs=1e-4)


def a_two_token_word(llm, reference):
    """(prompt, plain greedy output, position, word): two output tokens that spell a word
    which the tokenizer writes back as exactly those tokens (a random model's bytes mostly
    do not)."""
    tok = llm.get_tokenizer()
    for prompt in (PROMPT, "def main", "The quick brown fox"):
        plain = run(llm, prompt).outputs[0].token_ids
        for j in range(len(plain) - 2):
            word = tok.decode(plain[j:j + 2]).strip()
            spellings = [reference(w, add_special_tokens=False).input_ids for w in (word, " " + word)]
            if word.isprintable() and plain[j:j + 2] in spellings:
                return prompt, plain, j, word, spellings
    raise AssertionError("no output of the tiny model spells a word in two tokens")


def test_bad_words_are_never_generated(llm, path, hf_logprobs):
    reference = AutoTokenizer.from_pretrained(path)
    prompt, plain, j, word, spellings = a_two_token_word(llm, reference)
    out = run(llm, prompt, bad_words=[word])
    got = out.outputs[0].token_ids
    assert got[:j + 1] == plain[:j + 1] and got[j + 1] != plain[j + 1]
    assert not any(got[i:i + len(s)] == s for s in spellings for i in range(len(got)))

    def not_banned(j, history):
        banned = {s[-1] for s in spellings if history[len(history) - len(s) + 1:] == s[:-1]
                  and len(history) >= len(s) - 1}
        return [t for t in range(reference.vocab_size) if t not in banned]

    assert got == best_allowed(hf_logprobs, path, out, not_banned)
    # a word of one token is banned everywhere
    tok = llm.get_tokenizer()
    token = next(t for t in plain if [t] in [reference(w, add_special_tokens=False).input_ids
                                             for w in (tok.decode([t]).strip(), " " + tok.decode([t]).strip())])
    assert token not in run(llm, prompt, bad_words=[tok.decode([token])]).outputs[0].token_ids


def test_bad_words_spellings_follow_vllms_rule(path, tmp_path):
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    byte_level = AutoTokenizer.from_pretrained(path)
    words = bad_words_token_ids(byte_level, ["number", "  number"], byte_level.vocab_size)
    bare, spaced = (byte_level(w, add_special_tokens=False).input_ids for w in ("number", " number"))
    assert bare != spaced and words == [bare, spaced]  # (leading spaces stripped: no duplicate)
    assert bad_words_token_ids(byte_level, ["number"], min(max(bare), max(spaced))) in ([bare], [spaced], [])
    # a SentencePiece vocabulary writes the space into the word's first token itself
    sp = AutoTokenizer.from_pretrained(build_tiny_checkpoint(str(tmp_path / "sp"), tokenizer="sentencepiece"))
    bare, spaced = (sp(w, add_special_tokens=False).input_ids for w in ("number", " number"))
    expected = [bare] + ([spaced] if len(spaced) == len(bare) and spaced[0] != bare[0] else [])
    assert bad_words_token_ids(sp, ["number"], sp.vocab_size) == expected


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    tok = llm.get_tokenizer()
    ids = tok(PROMPT).input_ids
    out = run(llm, truncate_prompt_tokens=3)
    assert out.prompt_token_ids == ids[-3:] and out.prompt == PROMPT
    assert out.outputs[0].token_ids == run(llm, {"prompt_token_ids": ids[-3:]}).outputs[0].token_ids
    long = list(range(3, 3 + 100))  # longer than max_model_len=64: refused unless cut
    with pytest.raises(ValueError, match="max_model_len"):
        run(llm, {"prompt_token_ids": long})
    assert run(llm, {"prompt_token_ids": long}, truncate_prompt_tokens=20).prompt_token_ids == long[-20:]


def test_detokenize_false_gives_token_ids_only(llm):
    text = run(llm, logprobs=1, prompt_logprobs=1)
    ids = run(llm, logprobs=1, prompt_logprobs=1, detokenize=False)
    assert ids.outputs[0].token_ids == text.outputs[0].token_ids
    assert ids.outputs[0].text == "" and text.outputs[0].text
    assert all(lp.decoded_token is None for step in ids.outputs[0].logprobs for lp in step.values())
    assert all(lp.decoded_token is None for step in ids.prompt_logprobs[1:] for lp in step.values())
    assert all(lp.decoded_token is not None for step in text.outputs[0].logprobs for lp in step.values())


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(allowed_token_ids=[]), ValueError, r"allowed_token_ids=\[\] is not allowed; it must be a list of 1 to"),
    (dict(allowed_token_ids=[3, -1]), ValueError, r"allowed_token_ids=\[3, -1\] is not allowed.*\(ints >= 0\)"),
    (dict(allowed_token_ids="5"), ValueError, "allowed_token_ids='5' is not allowed"),
    (dict(bad_words=["ok", " "]), ValueError, r"bad_words=\[.ok., . .\] is not allowed.*\(non-blank strings"),
    (dict(bad_words="word"), ValueError, "bad_words='word' is not allowed; it must be a list"),
    (dict(truncate_prompt_tokens=0), ValueError, "truncate_prompt_tokens=0 is not allowed; it must be >= 1"),
    (dict(truncate_prompt_tokens=2.5), TypeError, "truncate_prompt_tokens must be an int"),
    (dict(detokenize=False, stop=["x"]), ValueError, r"stop=\['x'\] needs detokenize=True"),
    (dict(detokenize="no"), TypeError, "detokenize must be a bool"),
])
def test_bad_extras_are_clear_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_allowed_token_ids_outside_the_vocabulary_are_refused_before_anything_runs(llm):
    vocab = llm.llm_engine.config.model.vocab_size
    with pytest.raises(ValueError, match=rf"prompts\[1\]: allowed_token_ids holds token id {vocab}; "
                                         rf"allowed: 0 <= id < vocab size {vocab}"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(), SamplingParams(allowed_token_ids=[3, vocab])],
                     use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
