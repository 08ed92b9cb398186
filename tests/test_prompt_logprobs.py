"""Prompt log-probs (echo + logprobs, vLLM's prompt_logprobs), logit_bias and GET /v1/models/{id},
checked against transformers on the same tiny float32 checkpoint and driven by the unmodified
openai SDK."""

from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import openai
import pytest
import torch
from test_openai_server import CHAT_TEMPLATE, MESSAGES, call, make_engine, wait_idle
from transformers import AutoModelForCausalLM, AutoTokenizer

from omniinfer import LLM, SamplingParams
from omniinfer.entrypoints.openai.api_server import ServerState

TOL = 1e-4


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def check_prompt_entries(entries, prompt, ref, k):
    """vLLM's prompt log-probs: None first, then the prompt token and the k most likely."""
    assert entries[0] is None and len(entries) == len(prompt)
    for j in range(1, len(prompt)):
        entry, row = entries[j], ref[j - 1]
        assert abs(entry[prompt[j]].logprob - row[prompt[j]].item()) < TOL
        assert entry[prompt[j]].rank == int((row > row[prompt[j]]).sum()) + 1
        top = torch.topk(row, k)
        for value, tid in zip(top.values.tolist(), top.indices.tolist()):
            assert abs(entry[tid].logprob - value) < TOL


# ---- the engine: prefix caching and chunked prefill ---------------------------------------------
def test_a_steps_logits_for_prompt_log_probs_are_bounded(checkpoint_dir, hf_logprobs, monkeypatch):
    """The platform bounds a step's logits for prompt log-probs (the CPU's: 256 MiB; here made
    16 rows of this vocabulary): two prompts owed log-probs, with a plain one beside them, go
    in steps whose logits never hold more than 16 prompt rows; every entry is transformers'."""
    from omniinfer.sampling.sampler import Sampler
    from omniinfer_cpu.platform import CpuPlatform

    path = checkpoint_dir("llama")
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    monkeypatch.setattr(CpuPlatform, "prompt_logits_bytes", classmethod(lambda cls: 16 * 4 * vocab))
    prompt_rows = []
    call = Sampler.__call__

    def spy(self, logits, md):
        prompt_rows.append(sum(len(r.target_ids) for r in md.prompt_rows))
        return call(self, logits, md)

    monkeypatch.setattr(Sampler, "__call__", spy)
    prompts = [prompt_ids(37, seed=1), prompt_ids(30, seed=2), prompt_ids(25, seed=3)]
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)]
    with LLM(path, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=4) as llm:
        assert llm.llm_engine.scheduler.prompt_logprob_rows == 16
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert max(prompt_rows) == 16 and sum(prompt_rows) == 36 + 29
    for out, prompt, k in zip(outs[:2], prompts, (2, 1)):
        check_prompt_entries(out.prompt_logprobs, prompt, hf_logprobs(path, prompt), k)
    assert outs[2].prompt_logprobs is None


def test_prompt_logprobs_through_prefix_cache_and_chunks(checkpoint_dir, hf_logprobs):
    """A prompt whose blocks sit in the prefix cache still gets every prompt log-prob (the hit
    is skipped for it), in prefill chunks smaller than the prompt; other requests still hit."""
    path = checkpoint_dir("llama")
    llm = LLM(path, num_kv_blocks=64, block_size=8, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4)
    prompt = prompt_ids(37)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)  # fills the cache
    hits = llm.llm_engine.stats()["num_prefix_cache_hits"]
    llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)
    assert llm.llm_engine.stats()["num_prefix_cache_hits"] > hits, "the cache must be in use"
    scored = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3, n=2)
    (out,) = llm.generate({"prompt_token_ids": prompt}, scored, use_tqdm=False)
    ref = hf_logprobs(path, prompt)
    check_prompt_entries(out.prompt_logprobs, prompt, ref, 3)
    tokenizer = llm.get_tokenizer()
    assert all(lp.decoded_token == tokenizer.decode([t]) for entry in out.prompt_logprobs[1:]
               for t, lp in entry.items())
    stats = llm.llm_engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]


# ---- the server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(checkpoint_dir):
    state = ServerState("tiny", chat_template=CHAT_TEMPLATE, stats_interval_s=0)
    state.attach(make_engine(checkpoint_dir("llama"), enable_prefix_caching=True,
                             max_num_batched_tokens=16))
    yield state
    state.shutdown()


@pytest.fixture(scope="module")
def tokenizer(checkpoint_dir):
    return AutoTokenizer.from_pretrained(checkpoint_dir("llama"))


def check_echo_logprobs(lp, ids, ref, tokenizer, k, offset=0):
    """The legacy `logprobs` object of an echoed prompt `ids` (as OpenAI and vLLM write it)."""
    texts = [tokenizer.decode([t]) for t in ids]
    assert lp.tokens == texts
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected_offsets = [offset + sum(len(t) for t in texts[:i]) for i in range(len(ids))]
    assert lp.text_offset == expected_offsets
    for j in range(1, len(ids)):
        row = ref[j - 1]
        assert abs(lp.token_logprobs[j] - row[ids[j]].item()) < TOL
        top = lp.top_logprobs[j]
        assert len(top) <= k + 1 and texts[j] in top  # the prompt token and the k likeliest
        best = torch.topk(row, k)
        for value, tid in zip(best.values.tolist(), best.indices.tolist()):
            assert top[tokenizer.decode([tid])] >= value - TOL


def without_last(lp):
    return SimpleNamespace(**{k: getattr(lp, k)[:-1] for k in
                              ("tokens", "token_logprobs", "top_logprobs", "text_offset")})


def test_echo_logprobs_score_the_prompt(server, checkpoint_dir, hf_logprobs, tokenizer):
    path = checkpoint_dir("llama")
    ids = prompt_ids(21, seed=1)
    text = "Return the number of items in the list"
    text_ids = tokenizer(text).input_ids

    async def run(client, _http):
        # the prompt's blocks go to the prefix cache: the echo requests must not take the hit
        cached = await client.completions.create(model="tiny", prompt=ids, max_tokens=1,
                                                 temperature=0)
        zero = await client.completions.create(model="tiny", prompt=ids, echo=True, logprobs=2,
                                               max_tokens=0)
        one = await client.completions.create(model="tiny", prompt=[ids, text_ids], echo=True,
                                              logprobs=1, max_tokens=1, temperature=0)
        by_text = await client.completions.create(model="tiny", prompt=text, echo=True,
                                                  logprobs=1, max_tokens=0)
        return cached, zero, one, by_text

    cached, zero, one, by_text = call(server, run)
    ref = hf_logprobs(path, ids)
    (choice,) = zero.choices
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    check_echo_logprobs(choice.logprobs, ids, ref, tokenizer, 2)
    assert zero.usage.completion_tokens == 0 and zero.usage.prompt_tokens == len(ids)
    # max_tokens 1: the prompt, then the generated token (lm-evaluation-harness's request)
    first, second = one.choices
    lp = first.logprobs
    assert len(lp.tokens) == len(ids) + 1
    check_echo_logprobs(without_last(lp), ids, ref,
                        tokenizer, 1)
    assert lp.tokens[-1] == first.text[len(tokenizer.decode(ids)):] == cached.choices[0].text
    assert lp.token_logprobs[-1] <= 0
    check_echo_logprobs(without_last(second.logprobs),
                        text_ids, hf_logprobs(path, text_ids), tokenizer, 1)
    assert by_text.choices[0].text == text
    assert by_text.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in text_ids]
    wait_idle(server)


def test_streamed_echo_equals_the_whole_one(server, tokenizer):
    ids = prompt_ids(13, seed=2)

    async def run(client, _http):
        out = {}
        for max_tokens in (0, 4):
            kwargs = dict(model="tiny", prompt=ids, echo=True, logprobs=2, max_tokens=max_tokens,
                          temperature=0, extra_body={"ignore_eos": True})
            whole = await client.completions.create(**kwargs)
            chunks = [c async for c in await client.completions.create(stream=True, **kwargs)]
            out[max_tokens] = whole, chunks
        return out

    for whole, chunks in call(server, run).values():
        choice = whole.choices[0]
        assert "".join(c.choices[0].text for c in chunks) == choice.text
        merged = {"tokens": [], "token_logprobs": []}
        for c in chunks:
            for name in merged:
                merged[name] += getattr(c.choices[0].logprobs, name)
        assert merged == {name: getattr(choice.logprobs, name) for name in merged}
        # (later chunks count offsets in the text sent before, as vLLM does; the whole answer
        # adds up token texts, which differ where a token is part of a character)
        first = chunks[0].choices[0].logprobs.text_offset
        assert first == choice.logprobs.text_offset[:len(first)]
        assert chunks[-1].choices[0].finish_reason == "length"


def test_prompt_logprobs_extra_in_completions_and_chat(server, checkpoint_dir, hf_logprobs,
                                                       tokenizer):
    path = checkpoint_dir("llama")
    ids = prompt_ids(17, seed=3)

    async def run(client, _http):
        completion = await client.completions.create(model="tiny", prompt=ids, max_tokens=2,
                                                     extra_body={"prompt_logprobs": 2})
        chat = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                                    extra_body={"prompt_logprobs": 0})
        plain = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
        tokens = await _http.post("/tokenize", json={"messages": MESSAGES})
        return completion, chat, plain, tokens.json()["tokens"]

    completion, chat, plain, chat_ids = call(server, run)
    entries = completion.choices[0].model_extra["prompt_logprobs"]
    assert completion.choices[0].logprobs is None  # logprobs were not asked for
    ref = hf_logprobs(path, ids)
    assert entries[0] is None and len(entries) == len(ids)
    for j in range(1, len(ids)):
        entry = entries[j]
        assert abs(entry[str(ids[j])]["logprob"] - ref[j - 1][ids[j]].item()) < TOL
        assert entry[str(ids[j])]["decoded_token"] == tokenizer.decode([ids[j]])
        assert len(entry) in (2, 3) and all(v["rank"] >= 1 for v in entry.values())
    chat_entries = chat.model_extra["prompt_logprobs"]
    chat_ref = hf_logprobs(path, chat_ids)
    assert chat_entries[0] is None and len(chat_entries) == len(chat_ids)
    for j in range(1, len(chat_ids)):
        (only,) = chat_entries[j].items()  # prompt_logprobs 0: the prompt token alone
        assert only[0] == str(chat_ids[j])
        assert abs(only[1]["logprob"] - chat_ref[j - 1][chat_ids[j]].item()) < TOL
    assert plain.model_extra["prompt_logprobs"] is None


# ---- logit_bias ----------------------------------------------------------------------------------
def hf_biased_greedy(path: str, prompt: list[int], bias: dict[int, float], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0,
                             sequence_bias={(t,): b for t, b in bias.items()})
    return out[0, len(prompt):].tolist()


def test_logit_bias_matches_transformers_sequence_bias(server, checkpoint_dir, hf_greedy):
    path = checkpoint_dir("llama")
    prompt = prompt_ids(9, seed=4)
    plain = hf_greedy(path, prompt, 12)
    # push the first greedy token out, pull two others in by amounts that change the text
    bias = {plain[0]: -100.0, plain[3]: 2.5, 7: 1.5}
    expected = hf_biased_greedy(path, prompt, bias, 12)
    assert expected != plain
    llm = LLM(path, num_kv_blocks=32)
    (out,) = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                         logit_bias=bias), use_tqdm=False)
    assert out.outputs[0].token_ids == expected

    async def run(client, _http):
        biased = await client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0,
            logit_bias={str(t): b for t, b in bias.items()}, extra_body={"ignore_eos": True})
        forced = await client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.9, seed=3,
            logit_bias={"42": 100}, extra_body={"ignore_eos": True})
        return biased, forced

    biased, forced = call(server, run)
    assert biased.choices[0].text == llm.get_tokenizer().decode(expected)
    # +100 all but forces the token, even when sampling
    tokenizer = llm.get_tokenizer()
    assert forced.choices[0].message.content == tokenizer.decode([42] * 6)


@pytest.mark.parametrize(("bias", "words"), [
    ({5: 100.5}, ["logit_bias", "100.5", "[-100, 100]"]),
    ({-1: 1}, ["logit_bias", "-1", "token ids"]),
    ({"5": 1}, ["logit_bias", "'5'", "token ids"]),
    ({5: float("nan")}, ["logit_bias", "finite"]),
    ({5: "up"}, ["logit_bias", "number"]),
    ([5], ["logit_bias", "dict"]),
])
def test_logit_bias_is_validated(bias, words):
    with pytest.raises((ValueError, TypeError)) as e:
        SamplingParams(logit_bias=bias)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_logit_bias_token_past_the_vocabulary(checkpoint_dir):
    llm = LLM(checkpoint_dir("llama"), num_kv_blocks=16)
    vocab = llm.llm_engine.config.model.vocab_size
    with pytest.raises(ValueError, match=f"logit_bias holds token id {vocab}; allowed"):
        llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(logit_bias={vocab: 1.0}),
                     use_tqdm=False)


# ---- GET /v1/models/{id} -------------------------------------------------------------------------
def test_models_retrieve(server):
    async def run(client, http):
        found = await client.models.retrieve("tiny")
        with pytest.raises(openai.NotFoundError) as missing:
            await client.models.retrieve("org/other-model")
        return found, missing.value, await http.get("/v1/models/nope")

    found, missing, raw = call(server, run)
    assert found.id == "tiny" and found.object == "model" and found.owned_by == "omniinfer"
    assert missing.status_code == 404 and missing.body["code"] == "model_not_found"
    error = raw.json()["error"]
    assert raw.status_code == 404 and "`nope` does not exist" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
