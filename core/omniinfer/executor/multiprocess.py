"""The `mp` executor: one spawned local process per rank other than the driver.

Each worker is `python -m omniinfer.executor.worker_process` (a fresh interpreter: nothing
inherited from the engine's process, and the user's script is not re-imported, so it needs
no `if __name__ == "__main__"` guard) started in its own session (Ctrl-C reaches only the
engine, which then shuts the workers down). One socket pair per worker carries its spec,
start-up calls and replies, and then serves as a health pipe: a reader thread here sees a
worker's error report or, when it dies, the end of its stream; the worker sees the end of
the driver's stream when the engine's process dies and exits.

A worker's session is also its process group, so killing a worker kills the group: anything it
forked goes too, and with it any copy of the worker's sockets (a gloo socket a child still
holds keeps the driver's collective waiting on a dead rank).
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait

from omniinfer.executor.base import WorkerFailedError
from omniinfer.executor.distributed import DistributedExecutor, free_port
from omniinfer.executor.worker_process import WorkerSpec

READY_TIMEOUT_S = 300.0  # a worker process must import and report within this


def describe_exit(code: int | None) -> str:
    if code is None:
        return "closed its pipe to the driver but is still running"
    if code < 0:
        try:
            return f"died: killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"died: killed by signal {-code}"
    return f"died: exited with code {code}"


class MultiprocessExecutor(DistributedExecutor):
    def _start_workers(self) -> tuple[str, int]:
        limit = self.platform.max_local_ranks()
        if limit is not None and self.world_size > limit:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {self.world_size} ranks, but "
                f"platform {self.platform.name} has {limit} device(s) on this machine; lower the "
                "parallel sizes or use distributed_executor_backend='ray' across machines")
        self._procs: dict[int, subprocess.Popen] = {}
        self._conns: dict[int, Connection] = {}
        self._replies: dict[int, queue.Queue] = {}
        init_method = f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for rank in range(1, self.world_size):
            ours, theirs = socket.socketpair()
            with theirs:
                self._procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "omniinfer.executor.worker_process",
                     str(theirs.fileno())],
                    pass_fds=(theirs.fileno(),), start_new_session=True, env=env)
            self._conns[rank] = Connection(ours.detach())
            self._replies[rank] = queue.Queue()
            self._conns[rank].send(WorkerSpec(rank, rank, self.config, self.platform,
                                              self.attn_backend, init_method))
        self._reader = threading.Thread(
            target=_read_replies, name="omniinfer-mp-reader", daemon=True,
            args=(weakref.ref(self), dict(self._conns), dict(self._procs), self._replies))
        self._reader.start()
        self._pids = [self._result(rank, None, timeout_s=READY_TIMEOUT_S)
                      for rank in range(1, self.world_size)]
        return init_method, 0

    @property
    def worker_pids(self) -> list[int]:
        return list(getattr(self, "_pids", []))

    def _call_async(self, rank, method, args, kwargs):
        self._send(rank, ("call", method, args, kwargs))

    def _send(self, rank: int, message) -> None:
        with contextlib.suppress(OSError):  # the reader thread reports the dead worker
            self._conns[rank].send(message)

    def _result(self, rank, handle, timeout_s: float | None = None):
        waited = 0.0
        while True:
            if self._failure is not None:
                self._raise_failure()
            try:
                kind, value = self._replies[rank].get(timeout=0.05)
            except queue.Empty:
                waited += 0.05
                if timeout_s is not None and waited > timeout_s:
                    raise WorkerFailedError(rank, f"gave no answer within {timeout_s:.0f} s",
                                            self._procs[rank].pid) from None
                continue
            return value

    def _start_worker_loops(self) -> None:
        for rank in self._conns:
            self._send(rank, ("loop",))
        for rank in self._conns:
            self._result(rank, None)

    def _kill_workers(self) -> None:
        for proc in self._procs.values():
            _kill_group(proc)

    def _stop_workers(self, timeout_s: float) -> None:
        procs = getattr(self, "_procs", {})
        for proc in procs.values():
            _exited(proc, timeout_s)
            _kill_group(proc)  # the worker if it is still there, and whatever it left behind
            proc.wait()
            timeout_s = 0.5  # the first one used the grace period; the others had it too
        if getattr(self, "_reader", None) is not None:
            self._reader.join(2.0)  # it ends once every worker's stream has ended
        for conn in getattr(self, "_conns", {}).values():
            conn.close()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the worker's process group (its id is the worker's pid: the worker leads its own
    session). Only while the worker is unreaped, a zombie at worst: until then its pid, and so
    the group's id, cannot belong to anyone else."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _exited(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the worker to exit, without reaping it (see _kill_group)."""
    deadline = time.monotonic() + timeout_s
    while proc.returncode is None:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:  # reaped by a wait elsewhere
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _read_replies(executor_ref, conns: dict[int, Connection], procs: dict[int, subprocess.Popen],
                  replies: dict[int, queue.Queue]) -> None:
    """Reader thread: route replies to their rank's queue; report errors and deaths. Holds
    only a weak reference, so an engine that is dropped can still be collected."""
    rank_of = {conn: rank for rank, conn in conns.items()}
    while rank_of:
        try:
            ready = wait(list(rank_of), timeout=1.0)
        except OSError:  # a connection closed by shutdown
            return
        failures = []
        for conn in ready:
            rank = rank_of[conn]
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                del rank_of[conn]
                failures.append((rank, _death(procs[rank], 2.0)))
                continue
            if kind == "error":
                failures.append((rank, f"raised {value}"))
            else:
                replies[rank].put((kind, value))
        # A worker can exit with its stream still open: a child it forked holds the other end.
        for conn, rank in list(rank_of.items()):
            if conn not in ready and _exited(procs[rank], 0.0):
                del rank_of[conn]
                failures.append((rank, _death(procs[rank], 0.0)))
        for rank, cause in failures:
            executor = executor_ref()
            if executor is None:
                return
            executor._worker_failed(rank, cause, procs[rank].pid)
            del executor


def _death(proc: subprocess.Popen, timeout_s: float) -> str:
    """How a worker whose stream ended died (waiting up to `timeout_s` for it to exit); kills
    its process group, since what it forked may hold its sockets (see the top)."""
    exited = _exited(proc, timeout_s)
    _kill_group(proc)
    return describe_exit(proc.wait() if exited else None)
