"""Executors own the workers of one engine: where they run and how a step reaches them.

* `uniprocess`: one rank, in the engine's process (the default for one rank);
* `mp`: the driver (rank 0) in the engine's process, one spawned local process per other
  rank (the default for several ranks);
* `ray`: the driver in the engine's process, the other ranks as Ray actors in a placement
  group (several machines; `pip install 'omniinfer[ray]'`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from omniinfer.config import EngineConfig
from omniinfer.heap import release_freed_memory
from omniinfer.step import ModelRunnerOutput, SchedulerOutput


class WorkerFailedError(RuntimeError):
    """A rank raised or died; the engine cannot run further steps (the ranks are out of step)."""

    def __init__(self, rank: int, cause: str, pid: int | None = None):
        self.rank = rank
        self.cause = cause  # "raised Type: message" + the worker's traceback, or "died: ..."
        self.pid = pid
        where = f"worker rank {rank}" + (f" (pid {pid})" if pid is not None else "")
        super().__init__(f"{where} {cause}")


class Executor:
    """The interface the engine uses; `num_device_blocks`/`num_host_blocks` are set at start."""

    num_device_blocks: int
    num_host_blocks: int
    # called, from whichever thread notices, when a worker fails between or during steps (the
    # server's engine loop uses it to wake up and report at once, even while idle)
    on_failure: Callable[[], None] | None = None

    def __init__(self, config: EngineConfig, platform: type, attn_backend: type):
        self.config = config
        self.platform = platform
        self.attn_backend = attn_backend

    def check_health(self) -> None:
        """Raise WorkerFailedError if a worker has failed (cheap; safe from any thread)."""

    def execute_model(self, sched: SchedulerOutput) -> list[ModelRunnerOutput]:
        """The output of each of the schedule's `num_steps` steps (plain data both ways)."""
        raise NotImplementedError

    def release_idle_memory(self) -> None:
        """The engine has nothing left to run: the engine's process (the only rank, or the
        driver) gives the heap pages its steps' temporaries freed back to the system. glibc keeps
        them otherwise: a 128-token prompt on the medium model leaves ~20 MB in its free lists
        for good. (~2 ms when there is something to give back, ~0.2 ms when not; the next
        prompt faults its pages in again, ~5k of them. The other ranks' processes keep theirs.)"""
        release_freed_memory()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the ranks other than the driver (for monitoring and tests)."""
        return []

    def shutdown(self) -> None:
        """Release workers and processes; idempotent."""


def resolve_worker_cls(config: EngineConfig) -> type:
    """The worker class named by `worker_cls` ("package.module.Class")."""
    name = config.parallel.worker_cls
    module, _, attr = name.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker_cls={name!r} cannot be imported: {e}") from e


def executor_class(config: EngineConfig) -> type[Executor]:
    name = config.parallel.distributed_executor_backend
    if name is None:
        name = "uniprocess" if config.parallel.world_size == 1 else "mp"
    if name == "uniprocess":
        from omniinfer.executor.uniprocess import UniProcExecutor

        return UniProcExecutor
    if name == "mp":
        from omniinfer.executor.multiprocess import MultiprocessExecutor

        return MultiprocessExecutor
    if name == "ray":
        from omniinfer.executor.ray_executor import RayExecutor

        return RayExecutor
    raise ValueError(f"distributed_executor_backend={name!r} is not available; allowed: "
                     "'uniprocess', 'mp', 'ray'")
