"""Faults and shutdown of the `mp` executor: a worker that raises or dies fails the engine
within seconds with an error naming the rank and carrying the cause (never a hang in a
collective), and no process outlives the engine."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from omniinfer import LLM, SamplingParams
from omniinfer.distributed import parallel_state
from omniinfer.distributed.parallel_state import ENV_TIMEOUT
from omniinfer.executor.base import WorkerFailedError
from omniinfer.testing.faults import ENV_FAULT, ENV_ORPHAN_PIDFILE
from omniinfer.testing.processes import (
    assert_no_child_processes,
    child_pids,
    is_alive,
    wait_until_gone,
)

FAULTY = "omniinfer.testing.faults.FaultyWorker"
PROMPTS = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 30)]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
FAIL_FAST_S = 10.0
SHORT_TIMEOUT_S = "20"  # OMNIINFER_DIST_TIMEOUT_S where a gloo operation may be left to time out


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert_no_child_processes()
    # groups whose collective was abandoned may wait out a gloo operation (SHORT_TIMEOUT_S)
    parallel_state.wait_for_release(float(SHORT_TIMEOUT_S) + 10.0)
    assert not torch.distributed.is_initialized()


def failing_generate(llm) -> tuple[WorkerFailedError, float]:
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return info.value, time.monotonic() - start


@pytest.mark.parametrize("tp,pp,fault,words", [
    (2, 1, "1:3:raise", ["FaultInjected", "injected fault on rank 1 at step 3", "Traceback"]),
    (2, 1, "1:2:exit", ["died: exited with code 17"]),
    pytest.param(1, 2, "1:4:raise", ["FaultInjected"], marks=pytest.mark.slow),
    pytest.param(2, 2, "3:2:raise", ["FaultInjected"], marks=pytest.mark.slow),
])
def test_worker_fault_fails_the_engine_fast(tp, pp, fault, words, checkpoint_dir, monkeypatch):
    monkeypatch.setenv(ENV_FAULT, fault)
    rank = int(fault.split(":")[0])
    with LLM(checkpoint_dir("llama"), tensor_parallel_size=tp, pipeline_parallel_size=pp,
             worker_cls=FAULTY, num_kv_blocks=64) as llm:
        pids = llm.llm_engine.executor.worker_pids
        error, elapsed = failing_generate(llm)
        assert error.rank == rank and error.pid == pids[rank - 1]
        assert f"worker rank {rank} (pid {pids[rank - 1]})" in str(error)
        for word in words:
            assert word in str(error)
        assert elapsed < FAIL_FAST_S
        # the engine stays failed, at once, and its requests were released
        error, elapsed = failing_generate(llm)
        assert error.rank == rank and elapsed < 1.0
        assert not llm.llm_engine.has_unfinished_requests()
    assert wait_until_gone(pids) == []


@pytest.mark.parametrize("kind,word", [("raise", "FaultInjected"), ("exit", "exited with code 17")])
def test_worker_failing_at_start_fails_the_engine_fast(kind, word, checkpoint_dir, monkeypatch):
    monkeypatch.setenv(ENV_FAULT, f"1:0:{kind}")  # while loading the model
    start = time.monotonic()
    with pytest.raises(WorkerFailedError, match=rf"worker rank 1 \(pid \d+\) .*{word}"):
        LLM(checkpoint_dir("llama"), tensor_parallel_size=2, worker_cls=FAULTY, num_kv_blocks=64)
    assert time.monotonic() - start < 30.0  # includes starting the worker process


def test_killed_worker_fails_the_next_step(checkpoint_dir):
    with LLM(checkpoint_dir("llama"), tensor_parallel_size=2, num_kv_blocks=64) as llm:
        assert len(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == 3
        (pid,) = llm.llm_engine.executor.worker_pids
        os.kill(pid, signal.SIGKILL)
        error, elapsed = failing_generate(llm)
        assert error.rank == 1 and "killed by signal 9 (SIGKILL)" in str(error)
        assert elapsed < FAIL_FAST_S


def test_killed_worker_during_generation(checkpoint_dir, monkeypatch):
    """SIGKILL while the driver is busy stepping (most likely inside a step's collectives).
    Now and then the kill lands in the middle of a message to the driver, and gloo then never
    fails the driver's operation (it waits out its timeout): the executor's abandon ends the
    step, and shutdown leaves the groups to be destroyed once that operation times out."""
    monkeypatch.setenv(ENV_TIMEOUT, SHORT_TIMEOUT_S)
    long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    with LLM(checkpoint_dir("llama"), tensor_parallel_size=2, num_kv_blocks=256) as llm:
        (pid,) = llm.llm_engine.executor.worker_pids
        killed_at = []
        timer = threading.Timer(0.3, lambda: (killed_at.append(time.monotonic()),
                                              os.kill(pid, signal.SIGKILL)))
        timer.start()
        with pytest.raises(WorkerFailedError, match=r"worker rank 1 .*killed by signal 9"):
            llm.generate(PROMPTS, long, use_tqdm=False)
        timer.join()
        assert time.monotonic() - killed_at[0] < FAIL_FAST_S


@pytest.mark.parametrize("kind,tp,pp", [("fork", 2, 1), ("fork-setsid", 2, 1), ("fork-setsid", 1, 2)])
def test_dead_worker_whose_child_holds_its_sockets(kind, tp, pp, checkpoint_dir, monkeypatch, tmp_path):
    """Rank 1 exits mid-step while a child it forked still holds its sockets, so neither the
    driver's pipe nor gloo's sockets see the end of a stream: the death is noticed from its
    exit status, and the driver's collective is abandoned rather than left waiting on a peer
    whose socket stays open. The child goes with the worker's process group ("fork"); one that
    left the group ("fork-setsid") is what only the abandon can get past: with TP the driver
    waits in an all-reduce, with PP (rank 1 the last stage) for the logits from rank 1."""
    pidfile = tmp_path / "orphan.pid"
    monkeypatch.setenv(ENV_FAULT, f"1:3:{kind}")
    monkeypatch.setenv(ENV_ORPHAN_PIDFILE, str(pidfile))
    monkeypatch.setenv(ENV_TIMEOUT, "60")  # without the abandon: fails in a minute, not ten
    orphan = None
    try:
        with LLM(checkpoint_dir("llama"), tensor_parallel_size=tp, pipeline_parallel_size=pp,
                 worker_cls=FAULTY, num_kv_blocks=64) as llm:
            error, elapsed = failing_generate(llm)
            orphan = int(pidfile.read_text())
            assert error.rank == 1 and "exited with code 17" in str(error)
            assert elapsed < FAIL_FAST_S
            if kind == "fork-setsid":
                assert is_alive(orphan)  # its copies of the sockets were open all along
        if kind == "fork":
            assert wait_until_gone([orphan]) == []
    finally:
        if orphan is not None and is_alive(orphan):
            os.kill(orphan, signal.SIGKILL)


def test_shutdown_is_clean_and_idempotent(checkpoint_dir):
    llm = LLM(checkpoint_dir("llama"), tensor_parallel_size=2, pipeline_parallel_size=2,
              num_kv_blocks=64)
    pids = llm.llm_engine.executor.worker_pids
    assert len(pids) == 3 and set(pids) <= child_pids()
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    start = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - start < 5.0
    llm.shutdown()
    assert wait_until_gone(pids) == []
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def test_dropped_engine_releases_its_workers(checkpoint_dir):
    """No shutdown() call: collecting the LLM stops the workers and leaves the process
    groups, so another distributed engine can start in this process."""
    llm = LLM(checkpoint_dir("llama"), tensor_parallel_size=2, num_kv_blocks=64)
    pids = llm.llm_engine.executor.worker_pids
    del llm
    gc.collect()
    assert wait_until_gone(pids) == []
    assert not torch.distributed.is_initialized()


_DRIVER_DIES = textwrap.dedent("""
    import os, signal, sys
    from omniinfer import LLM
    llm = LLM(sys.argv[1], tensor_parallel_size=2, num_kv_blocks=64)
    print(*llm.llm_engine.executor.worker_pids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_workers_exit_when_the_engine_process_dies(checkpoint_dir):
    """SIGKILL the engine's process: no shutdown runs, yet every worker notices and exits."""
    proc = subprocess.run([sys.executable, "-c", _DRIVER_DIES, checkpoint_dir("llama")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    assert wait_until_gone(pids, timeout_s=10.0) == []

