"""Bad input raises ValueError/TypeError naming the argument, the value and what is allowed,
and leaves the engine and every other request untouched."""

from __future__ import annotations

import math

import pytest

from omniinfer import LLM, SamplingParams


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(temperature=-0.5), ValueError, ["temperature=-0.5", "[0, 100]"]),
    (dict(temperature=math.nan), ValueError, ["temperature=nan", "finite"]),
    (dict(temperature=math.inf), ValueError, ["temperature=inf", "finite"]),
    (dict(top_p=0.0), ValueError, ["top_p=0.0", "(0, 1]"]),
    (dict(top_p=1.5), ValueError, ["top_p=1.5", "(0, 1]"]),
    (dict(min_p=-0.1), ValueError, ["min_p=-0.1", "[0, 1]"]),
    (dict(min_p=1.1), ValueError, ["min_p=1.1", "[0, 1]"]),
    (dict(top_k=-2), ValueError, ["top_k=-2", "-1"]),
    (dict(n=0), ValueError, ["n=0", ">= 1"]),
    (dict(max_tokens=0), ValueError, ["max_tokens=0", ">= 1"]),
    (dict(max_tokens=4, min_tokens=5), ValueError, ["min_tokens=5", "max_tokens=4"]),
    (dict(logprobs=-1), ValueError, ["logprobs=-1", ">= 0"]),
    (dict(prompt_logprobs=-5), ValueError, ["prompt_logprobs=-5", ">= 0"]),
    (dict(n=1.5), TypeError, ["n must be an int", "1.5"]),
    (dict(temperature="hot"), TypeError, ["temperature must be a number", "'hot'"]),
    (dict(stop=[""]), TypeError, ["stop=", "non-empty"]),
    (dict(repetition_penalty=0), ValueError, ["repetition_penalty=0", "[0.01, 100]"]),
    # issue 18 item 1: upper bounds for everything that reaches a tensor of the step
    (dict(top_k=2**63), ValueError, ["top_k=9223372036854775808", "2147483647"]),
    (dict(repetition_penalty=1e308), ValueError, ["repetition_penalty=1e+308", "[0.01, 100]"]),
    (dict(repetition_penalty=1e-300), ValueError, ["repetition_penalty=1e-300", "[0.01, 100]"]),
    (dict(temperature=1e308), ValueError, ["temperature=1e+308", "[0, 100]"]),
    (dict(seed=2**64), ValueError, ["seed=18446744073709551616", "64-bit"]),
    (dict(stop=["x"] * 65), ValueError, ["stop=", "at most 64"]),
    (dict(stop="x" * 1025), ValueError, ["stop=", "1024 characters"]),
    (dict(stop_token_ids=list(range(1025))), ValueError, ["stop_token_ids=", "at most 1024"]),
    (dict(stop_token_ids=[-1]), ValueError, ["stop_token_ids=[-1]", "non-negative"]),
    (dict(n=True), TypeError, ["n must be an int", "True"]),
])
def test_sampling_params_errors(kwargs, error, words):
    with pytest.raises(error) as info:
        SamplingParams(**kwargs)
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(block_size=12), ValueError, ["block_size=12", "allowed", "16"]),
    (dict(preemption_mode="pause"), ValueError, ["preemption_mode='pause'", "'recompute', 'swap'"]),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=100), ValueError,
     ["max_num_batched_tokens=100", "max_model_len=512"]),
    (dict(max_num_batched_tokens=8, max_num_seqs=16), ValueError,
     ["max_num_batched_tokens=8", "max_num_seqs=16"]),
    (dict(max_model_len=4096), ValueError, ["max_model_len=4096", "max_position_embeddings=512"]),
    (dict(dtype="int8"), ValueError, ["dtype='int8'", "'bfloat16'"]),
    (dict(num_kv_blocks=0), ValueError, ["num_kv_blocks=0", ">= 1"]),
    (dict(device="tpu"), ValueError, ["'tpu'", "not installed", "cpu: available"]),
    (dict(attention_backend="NOPE"), ValueError, ["'NOPE'", "TORCH_SDPA"]),
    (dict(swap_space=-1), ValueError, ["swap_space=-1", ">= 0"]),
    (dict(tensor_parallel_size=0), ValueError, ["tensor_parallel_size=0", ">= 1"]),
    (dict(bogus=1), TypeError, ["'bogus'", "allowed"]),
    (dict(max_logprobs=-2), ValueError, ["max_logprobs=-2", ">= -1"]),
])
def test_engine_argument_errors(kwargs, error, words, checkpoint_dir):
    with pytest.raises(error) as info:
        LLM(checkpoint_dir("llama"), **kwargs)
    for word in words:
        assert word in str(info.value)


def test_numpy_numbers_are_accepted_as_python_numbers():
    import numpy as np

    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_k=np.int32(7),
                       seed=np.uint64(2**64 - 1), max_tokens=np.int64(4), logprobs=np.int8(1),
                       stop_token_ids=np.array([3, 4]))
    assert (p.n, p.top_k, p.seed, p.max_tokens, p.logprobs) == (2, 7, 2**64 - 1, 4, 1)
    assert all(type(v) is int for v in (p.n, p.top_k, p.seed, p.max_tokens, p.logprobs))
    assert type(p.temperature) is float and p.stop_token_ids == [3, 4]
    assert all(type(t) is int for t in p.stop_token_ids)
    with pytest.raises(TypeError, match="n must be an int"):
        SamplingParams(n=np.bool_(True))


def test_model_path_errors(tmp_path):
    with pytest.raises(ValueError, match="is not a checkpoint directory"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path))


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(checkpoint_dir("llama"), num_kv_blocks=64, max_model_len=64)


@pytest.mark.parametrize("prompt,params,error,words", [
    ("", None, ValueError, ["prompt is empty"]),
    ({"prompt_token_ids": []}, None, ValueError, ["prompt_token_ids is empty"]),
    ({"prompt_token_ids": [1, -3]}, None, ValueError, ["token id -3", "vocab size 384"]),
    ({"prompt_token_ids": [1, 384]}, None, ValueError, ["token id 384", "vocab size 384"]),
    ({"prompt_token_ids": [1, 2.0]}, None, TypeError, ["must hold ints", "2.0"]),
    ({"prompt_token_ids": [1, True]}, None, TypeError, ["must hold ints", "True"]),
    (42, None, TypeError, ["prompt must be a string"]),
    ({"prompt_token_ids": list(range(60))}, SamplingParams(max_tokens=10), ValueError,
     ["60 tokens", "max_tokens=10", "70 exceeds max_model_len=64"]),
    ({"prompt_token_ids": list(range(64))}, SamplingParams(max_tokens=None), ValueError,
     ["64 tokens", "max_model_len=64"]),
    # issue 18: the engine's own limits, checked when the request is added
    ("hi", SamplingParams(logprobs=21), ValueError, ["logprobs=21", "[0, 20]", "max_logprobs"]),
    ("hi", SamplingParams(prompt_logprobs=50), ValueError, ["prompt_logprobs=50", "[0, 20]"]),
    ("hi", SamplingParams(n=257), ValueError, ["n=257", "max_num_seqs=256"]),
    ("hi", SamplingParams(stop_token_ids=[384]), ValueError, ["stop_token_ids", "384"]),
    ("Return the\ud800", None, ValueError, ["prompt holds invalid Unicode", "10", "surrogate"]),
    ({"prompt_token_ids": [[1, 2]]}, None, TypeError, ["must hold ints"]),
])
def test_request_errors_leave_others_untouched(llm, prompt, params, error, words):
    engine = llm.llm_engine
    engine.add_request("bystander", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.step()
    with pytest.raises(error) as info:
        engine.add_request("bad", prompt, params)
    for word in words:
        assert word in str(info.value)
    assert "bad" not in engine.groups
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    done = [o for o in outputs if o.finished]
    assert [o.request_id for o in done] == ["bystander"] and len(done[0].outputs[0].token_ids) == 3
    stats = engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]


def test_duplicate_request_id(llm):
    engine = llm.llm_engine
    engine.add_request("same", {"prompt_token_ids": [5]}, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id='same' is already in use"):
        engine.add_request("same", {"prompt_token_ids": [6]}, SamplingParams(max_tokens=2))
    engine.abort_request("same")
    assert not engine.has_unfinished_requests()


def test_generate_checks_every_prompt_before_starting(llm):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt_token_ids holds token id 999"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [999]}], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_generate_input_types(llm):
    """issue 18 item 10: a clear TypeError for what is not a prompt, numpy token ids accepted."""
    import numpy as np

    with pytest.raises(TypeError, match="prompts must be a string, a dict with 'prompt' or "
                       "'prompt_token_ids', or a list of them; got int"):
        llm.generate(5, use_tqdm=False)
    with pytest.raises(TypeError, match=r"prompts\[0\]: prompt must be a string"):
        llm.generate([5], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt holds invalid Unicode"):
        llm.generate("\ud800", use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = [5, 6, 7]
    expected = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    for given in (np.array(ids), np.array(ids, dtype=np.int32), [np.int64(t) for t in ids],
                  tuple(ids)):
        (out,) = llm.generate({"prompt_token_ids": given}, params, use_tqdm=False)
        assert out.prompt_token_ids == ids and all(type(t) is int for t in out.prompt_token_ids)
        assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    with pytest.raises(TypeError, match="1-D array of ints"):
        llm.generate({"prompt_token_ids": np.array([1.0, 2.0])}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_huge_sampling_values_cannot_reach_the_step(llm):
    """issue 18 item 1: top_k=2**63 or repetition_penalty=1e308 batched with an innocent request
    killed both (and the engine); now they are refused before anything is queued, and a top_k
    above the vocabulary keeps every token."""
    for bad in (dict(top_k=2**63), dict(repetition_penalty=1e308)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(temperature=1, top_p=0.9, max_tokens=4, **bad)
    innocent = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    wide = SamplingParams(temperature=1, top_p=0.9, top_k=2**31 - 1, repetition_penalty=100,
                          max_tokens=4, ignore_eos=True, seed=1)
    outs = llm.generate(["Return the", "Return the"], [innocent, wide], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    stats = llm.llm_engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]
