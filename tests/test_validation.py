"""Bad input raises ValueError/TypeError naming the argument, the value and what is allowed,
and leaves the engine and every other request untouched."""

from __future__ import annotations

import math

import pytest

from omniinfer import LLM, SamplingParams


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(temperature=-0.5), ValueError, ["temperature=-0.5", ">= 0"]),
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
    (dict(logprobs=-1), ValueError, ["logprobs=-1", "[0, 20]"]),
    (dict(logprobs=21), ValueError, ["logprobs=21", "[0, 20]"]),
    (dict(prompt_logprobs=50), ValueError, ["prompt_logprobs=50", "[0, 20]"]),
    (dict(n=1.5), TypeError, ["n must be an int", "1.5"]),
    (dict(temperature="hot"), TypeError, ["temperature must be a number", "'hot'"]),
    (dict(stop=[""]), TypeError, ["stop=", "non-empty"]),
    (dict(repetition_penalty=0), ValueError, ["repetition_penalty=0", "> 0"]),
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
])
def test_engine_argument_errors(kwargs, error, words, checkpoint_dir):
    with pytest.raises(error) as info:
        LLM(checkpoint_dir("llama"), **kwargs)
    for word in words:
        assert word in str(info.value)


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
