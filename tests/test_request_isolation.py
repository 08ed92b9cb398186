"""The engine's second line of defence (issue 18): when processing one request fails inside a
step (its sampling, logits processing, detokenisation, stop handling), that request ends with
an error and every other request in the batch goes on unchanged. Only a failure of the model
or the device fails the step."""

from __future__ import annotations

import pytest

from omniinfer import LLM, SamplingParams
from omniinfer.engine import output_processor
from omniinfer.sampling import processing

MARK = 1.25  # presence_penalty that marks the poisoned request
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True)
POISONED = SamplingParams(temperature=1.0, presence_penalty=MARK, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]},
           {"prompt_token_ids": [10, 11, 12, 13]}]


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(checkpoint_dir("llama"), num_kv_blocks=64, block_size=8, num_scheduler_steps=1)


def assert_idle(llm) -> None:
    engine = llm.llm_engine
    stats = engine.stats()
    assert not engine.has_unfinished_requests()
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]


def poison_penalties(monkeypatch):
    real = processing.apply_penalties

    def apply_penalties(logits, rows):
        if any(row.params.presence_penalty == MARK for row in rows):
            raise RuntimeError("value cannot be converted to type float without overflow")
        return real(logits, rows)

    monkeypatch.setattr(processing, "apply_penalties", apply_penalties)


def texts(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_a_sampling_failure_ends_only_its_request(llm, monkeypatch):
    expected = texts(llm.generate(PROMPTS[:2], [GREEDY, SEEDED], use_tqdm=False))
    poison_penalties(monkeypatch)
    outs = llm.generate(PROMPTS, [GREEDY, SEEDED, POISONED], use_tqdm=False)
    assert texts(outs[:2]) == expected
    bad = outs[2]
    assert bad.finished and bad.outputs[0].finish_reason == "error" and bad.is_internal_error
    assert "failed inside the engine" in bad.error and "without overflow" in bad.error
    assert_idle(llm)
    # a batch of nothing but failing requests does not take the engine down either
    outs = llm.generate(PROMPTS, POISONED, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "error" for o in outs)
    assert texts(llm.generate(PROMPTS[:2], [GREEDY, SEEDED], use_tqdm=False)) == expected
    assert_idle(llm)


def test_a_detokenizer_or_stop_failure_ends_only_its_request(llm, monkeypatch):
    expected = texts(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
    engine = llm.llm_engine
    real_find_stop = output_processor.find_stop

    def find_stop(text, num_new, stops):
        if "BOOM" in stops:
            raise IndexError("stop handling went wrong")
        return real_find_stop(text, num_new, stops)

    monkeypatch.setattr(output_processor, "find_stop", find_stop)
    engine.add_request("a", PROMPTS[0], GREEDY, stream=False)
    engine.add_request("b", PROMPTS[1], GREEDY, stream=True)
    engine.add_request("stop", PROMPTS[2], SamplingParams(temperature=0, max_tokens=6,
                                                          stop=["BOOM"], ignore_eos=True))
    engine.add_request("detok", PROMPTS[2], GREEDY, stream=True)

    class BrokenDetokenizer:
        def __getattr__(self, name):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    engine.groups["detok"].seqs[0].detok = BrokenDetokenizer()
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert [finished["a"].outputs[0].token_ids, finished["b"].outputs[0].token_ids] == expected
    for rid, word in (("stop", "IndexError: stop handling"), ("detok", "UnicodeDecodeError")):
        assert finished[rid].outputs[0].finish_reason == "error" and word in finished[rid].error
    assert_idle(llm)


def test_a_model_failure_still_fails_the_step(llm, monkeypatch):
    def execute_model(request):
        raise RuntimeError("the device fell off the bus")

    monkeypatch.setattr(llm.llm_engine.executor, "execute_model", execute_model)
    with pytest.raises(RuntimeError, match="fell off the bus"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # generate aborted its requests


def test_isolation_with_multi_step_and_tensor_parallel_workers(checkpoint_dir, monkeypatch):
    """The sampler runs on the driver after the ranks' collectives: a request's failure there
    leaves the workers in step, and a multi-step run feeds the others' tokens on."""
    real = processing._top_k_top_p

    def top_k_top_p(logits, top_k, top_p):
        if 0.77 in top_p:
            raise RuntimeError("Overflow when unpacking long long")
        return real(logits, top_k, top_p)

    monkeypatch.setattr(processing, "_top_k_top_p", top_k_top_p)
    poisoned = SamplingParams(temperature=1.0, top_p=0.77, max_tokens=6, ignore_eos=True)
    with LLM(checkpoint_dir("llama"), tensor_parallel_size=2, num_kv_blocks=64, block_size=8,
             num_scheduler_steps=4) as llm:
        expected = texts(llm.generate(PROMPTS[:2], [GREEDY, SEEDED], use_tqdm=False))
        schedule, steps = llm.llm_engine.scheduler.schedule, []
        monkeypatch.setattr(llm.llm_engine.scheduler, "schedule",
                            lambda: steps.append(schedule()) or steps[-1])
        outs = llm.generate(PROMPTS, [GREEDY, SEEDED, poisoned], use_tqdm=False)
        assert texts(outs[:2]) == expected and outs[2].outputs[0].finish_reason == "error"
        assert max(s.num_steps for s in steps) == 4  # it failed inside a multi-step run
        assert texts(llm.generate(PROMPTS[:2], [GREEDY, SEEDED], use_tqdm=False)) == expected
        assert_idle(llm)
