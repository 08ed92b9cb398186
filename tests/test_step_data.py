"""What crosses between the engine and the workers each step is plain data (omniinfer/step.py):
numbers, strings, lists, dicts, SamplingParams and the step's own dataclasses; it survives a
pickle round trip, so the driver worker could live in another process."""

from __future__ import annotations

import dataclasses
import pickle

from omniinfer import LLM, SamplingParams
from omniinfer.step import Logprob, ModelRunnerOutput, NewSeq, SchedulerOutput

PLAIN = (int, float, str, bool, type(None))
STEP_TYPES = (SchedulerOutput, ModelRunnerOutput, NewSeq, Logprob, SamplingParams)


def assert_plain(value, where: str) -> None:
    if isinstance(value, PLAIN):
        return
    if isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(value):
            assert_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            assert_plain(key, f"{where} key")
            assert_plain(item, f"{where}[{key!r}]")
        return
    assert isinstance(value, STEP_TYPES), f"{where} is a {type(value).__name__}"
    for f in dataclasses.fields(value):
        assert_plain(getattr(value, f.name), f"{where}.{f.name}")


def test_a_steps_data_is_plain(checkpoint_dir):
    llm = LLM(checkpoint_dir("llama"), num_kv_blocks=64, num_scheduler_steps=1)
    executor = llm.llm_engine.executor
    seen = []
    execute = executor.execute_model

    def recording(sched):
        outputs = execute(sched)
        seen.append((sched, outputs))
        return outputs

    executor.execute_model = recording
    params = [SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=1),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=3, stop=["zz"]),
              SamplingParams(temperature=0, max_tokens=3, repetition_penalty=1.3)]
    llm.generate([{"prompt_token_ids": p} for p in ([5, 6, 7], [8, 9], [10, 11, 12, 13])], params,
                 use_tqdm=False)
    assert any(s.new_seqs for s, _ in seen) and any(s.finished_seq_ids for s, _ in seen)
    assert any(o.logprobs for _, outs in seen for o in outs)
    assert any(o.prompt_logprobs for _, outs in seen for o in outs)
    assert any(len(t) == 2 for _, outs in seen for o in outs for t in o.token_ids)  # the fork
    for i, (sched, outputs) in enumerate(seen):
        assert_plain(sched, f"step {i} SchedulerOutput")
        assert pickle.loads(pickle.dumps(sched)) == sched
        for out in outputs:
            assert_plain(out, f"step {i} ModelRunnerOutput")
            assert pickle.loads(pickle.dumps(out)) == out
