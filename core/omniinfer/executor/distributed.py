"""What the `mp` and `ray` executors share: the driver in this process, the other ranks
elsewhere, the start-up sequence, fault handling and shutdown.

Start-up: every other rank is started and reports ready; then all ranks at once bind their
device and join the process groups (the rendezvous needs them all), load their part of the
model and measure their KV-cache room (the smallest wins), allocate it, and the other ranks
enter their execution loop, where they wait for the driver's per-step broadcast.

Faults: a subclass watches its workers (a pipe per process, a Ray object per loop) and calls
`_worker_failed(rank, cause)` when one raises or dies. That records the failure, kills every
other rank, and abandons this process's collectives (distributed/waits.py): a gloo collective
the driver waits in ends within a fraction of a second, whether or not gloo noticed the dead
peer's socket closing. The step in flight, or the next one, raises `WorkerFailedError` naming
the rank and carrying the cause. Process groups also have a timeout
(`OMNIINFER_DIST_TIMEOUT_S`) as the last resort against a rank that hangs alive.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import weakref
from typing import Any

import torch.distributed

from omniinfer.distributed import parallel_state, waits
from omniinfer.executor.base import Executor, WorkerFailedError, resolve_worker_cls
from omniinfer.logger import init_logger

logger = init_logger(__name__)

FAILURE_GRACE_S = 5.0  # how long a failed step waits for a worker's report before blaming rank 0
STOP_GRACE_S = 5.0  # how long shutdown waits for workers to leave their loop before killing them

_live: weakref.WeakSet[DistributedExecutor] = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    for executor in list(_live):
        try:
            executor.shutdown()
        except Exception as e:  # e.g. Ray already shut down by its own exit hook
            logger.debug("shutdown at exit: %s", e)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DistributedExecutor(Executor):
    """Rank 0 (the driver) runs here; subclasses start and reach ranks 1..world-1."""

    def __init__(self, config, platform, attn_backend, progress: bool = True):
        super().__init__(config, platform, attn_backend)
        self.world_size = config.parallel.world_size
        self.driver = None
        self._lock = threading.Lock()
        self._failure: WorkerFailedError | None = None
        self._is_stopping = False
        self._is_shut_down = False
        self._loops_running = False
        if torch.distributed.is_initialized():
            raise RuntimeError(parallel_state.pending_release() or (
                "torch.distributed is already initialised in this process (another distributed "
                "engine?): one per process; shut the other one down"))
        try:
            init_method, driver_local_rank = self._start_workers()
            self.driver = resolve_worker_cls(config)(
                config, platform, attn_backend, rank=0, local_rank=driver_local_rank,
                is_driver=True, distributed_init_method=init_method)
            self._run_workers("init_device")
            self._run_workers("load_model", driver_kwargs={"progress": progress}, progress=False)
            blocks = self._run_workers("determine_num_blocks")
            self.num_device_blocks = min(b[0] for b in blocks)
            self.num_host_blocks = min(b[1] for b in blocks)
            self._run_workers("initialize_cache", self.num_device_blocks, self.num_host_blocks)
            self._start_worker_loops()
            self._loops_running = True
        except BaseException:
            self.shutdown()
            raise
        _live.add(self)
        p = config.parallel
        logger.info("%s executor: %d ranks (tensor_parallel_size=%d, pipeline_parallel_size=%d); "
                    "worker pids %s", type(self).__name__, self.world_size,
                    p.tensor_parallel_size, p.pipeline_parallel_size, self.worker_pids)

    # ---- what subclasses provide ------------------------------------------------------------------
    def _start_workers(self) -> tuple[str, int]:
        """Start ranks 1..world-1 and wait until they are ready; returns the process-group
        init method ("tcp://host:port") and the driver's local rank."""
        raise NotImplementedError

    def _call_async(self, rank: int, method: str, args: tuple, kwargs: dict) -> Any:
        """Start `worker.method(*args, **kwargs)` on `rank`; returns a handle for `_result`."""
        raise NotImplementedError

    def _result(self, rank: int, handle: Any) -> Any:
        """Wait for a call's value; raise WorkerFailedError when the rank failed."""
        raise NotImplementedError

    def _start_worker_loops(self) -> None:
        """Put ranks 1..world-1 in `start_worker_execution_loop` and start watching them."""
        raise NotImplementedError

    def _kill_workers(self) -> None:
        """Kill every other rank now (any thread may call it)."""
        raise NotImplementedError

    def _stop_workers(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the workers to leave, then kill and reap them."""
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------------------
    def _run_workers(self, method: str, *args, driver_kwargs: dict | None = None, **kwargs) -> list:
        """Call `method` on every rank at once (the driver's call runs here, in between);
        returns the results by rank."""
        handles = [(rank, self._call_async(rank, method, args, kwargs))
                   for rank in range(1, self.world_size)]
        first = getattr(self.driver, method)(*args, **(kwargs if driver_kwargs is None else driver_kwargs))
        return [first] + [self._result(rank, handle) for rank, handle in handles]

    def _worker_failed(self, rank: int, cause: str, pid: int | None = None) -> None:
        """Record the first failure (not during shutdown) and kill every other rank."""
        with self._lock:
            if self._failure is not None or self._is_stopping:
                return
            self._failure = WorkerFailedError(rank, cause, pid)
        logger.error("%s", self._failure)
        self._kill_workers()
        waits.abandon(str(self._failure))
        if self.on_failure is not None:
            self.on_failure()

    def check_health(self) -> None:
        if self._failure is not None:
            self._raise_failure()

    def _raise_failure(self, cause: BaseException | None = None):
        f = self._failure
        if f is None:  # a shutdown from another thread ended the step
            raise RuntimeError("the executor was shut down during the step") from cause
        raise WorkerFailedError(f.rank, f.cause, f.pid) from cause

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            self._raise_failure()
        if self._is_shut_down:
            raise RuntimeError("the executor is shut down")

    def execute_model(self, sched):
        self._raise_if_failed()
        try:
            return self.driver.execute_model(sched)
        except BaseException as e:
            # Any exit mid-step leaves the ranks out of step: the engine is done. A rank that
            # failed is usually why the driver's collective failed: give its report a moment
            # to arrive, else the driver itself is the cause.
            deadline = time.monotonic() + (FAILURE_GRACE_S if isinstance(e, Exception) else 0)
            while self._failure is None and time.monotonic() < deadline:
                time.sleep(0.02)
            self._worker_failed(0, f"raised {type(e).__name__}: {e}", os.getpid())
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt, SystemExit: as they are
            self._raise_failure(e)

    def shutdown(self) -> None:
        with self._lock:
            if self._is_shut_down:
                return
            self._is_shut_down = self._is_stopping = True
        _live.discard(self)
        stop = None
        try:
            if self._loops_running and self._failure is None:
                # In a thread: a rank that stopped listening must not hang shutdown.
                stop = threading.Thread(target=self._broadcast_stop, daemon=True)
                stop.start()
                stop.join(STOP_GRACE_S)
            # workers not in their loop (start-up failed) are not listening: no grace
            self._stop_workers(STOP_GRACE_S if stop is not None else 0.0)
            waits.abandon("the engine shut down")  # a step still waiting on another thread ends
            if stop is not None:
                stop.join(1.0)  # the workers are gone: let it finish before the groups go
        finally:
            if self.driver is not None:
                self.driver.shutdown()

    def _broadcast_stop(self) -> None:
        try:
            self.driver.stop_worker_execution_loop()
        except Exception as e:  # a worker already gone: it is killed next anyway
            logger.debug("stop signal not delivered: %s", e)
