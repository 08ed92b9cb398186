"""The Ray executor on a local Ray instance started here: TP=2 gives one rank's tokens, one
broadcast per step; faults fail fast; shutdown kills the actors."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from omniinfer import LLM, SamplingParams
from omniinfer.distributed.communication import BroadcastStats
from omniinfer.executor.base import WorkerFailedError
from omniinfer.testing.faults import ENV_FAULT
from omniinfer.testing.processes import wait_until_gone

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'omniinfer[ray]')")

PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 30, 9)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(num_kv_blocks=10, block_size=8, max_num_batched_tokens=12, max_num_seqs=4)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMNIINFER_CPU_THREADS": "1"}})
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert not torch.distributed.is_initialized()


def test_ray_tensor_parallel_matches_one_rank(local_ray, checkpoint_dir):
    path = checkpoint_dir("llama")
    with LLM(path, **ENGINE) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE) as llm:
        engine = llm.llm_engine
        pids = engine.executor.worker_pids
        assert len(pids) == 1 and pids[0] != os.getpid()
        steps = []
        execute = engine.executor.execute_model
        engine.executor.execute_model = lambda request: steps.append(request.num_steps) or execute(request)
        BroadcastStats.reset()
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert engine.stats()["num_preemptions"] > 0
        assert BroadcastStats.num_broadcasts == sum(steps) > 0  # one per decode step
    assert wait_until_gone(pids) == []


@pytest.mark.parametrize("fault", ["raise", "kill"])
def test_ray_worker_fault_fails_fast(fault, local_ray, checkpoint_dir, monkeypatch):
    if fault == "raise":
        monkeypatch.setenv(ENV_FAULT, "1:3:raise")
    with LLM(checkpoint_dir("llama"), tensor_parallel_size=2, distributed_executor_backend="ray",
             worker_cls="omniinfer.testing.faults.FaultyWorker", **ENGINE) as llm:
        pids = llm.llm_engine.executor.worker_pids
        if fault == "kill":
            os.kill(pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError) as info:
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert time.monotonic() - start < 10.0
        assert info.value.rank == 1 and f"(pid {pids[0]})" in str(info.value)
        assert ("FaultInjected" if fault == "raise" else "died") in str(info.value)
    assert wait_until_gone(pids) == []
