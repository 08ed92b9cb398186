"""Fault injection for the distributed tests: a worker that fails on purpose.

Select it with `worker_cls="omniinfer.testing.faults.FaultyWorker"` and describe the fault
in OMNIINFER_TEST_FAULT="RANK:STEP:KIND" (read in each worker's own process, so it reaches
spawned processes and Ray actors alike): on rank RANK, at its STEP-th step (from 1; 0 means
while loading the model), KIND "raise" raises FaultInjected, "exit" ends the process with
code 17. "fork" and "fork-setsid" end it with code 17 too, but first fork a child that
inherits every descriptor (the gloo sockets, the pipe to the driver) and sleeps for
ORPHAN_LIFE_S, its pid written to $OMNIINFER_TEST_ORPHAN_PIDFILE; with "fork-setsid" the child
leaves for a session of its own, out of reach of a kill of the worker's process group.
"""

from __future__ import annotations

import os
import time

from omniinfer.worker.worker_base import Worker

ENV_FAULT = "OMNIINFER_TEST_FAULT"
ENV_ORPHAN_PIDFILE = "OMNIINFER_TEST_ORPHAN_PIDFILE"
ORPHAN_LIFE_S = 120.0


class FaultInjected(RuntimeError):
    pass


class FaultyWorker(Worker):
    num_steps = 0

    def _maybe_fail(self, step: int) -> None:
        rank, at, kind = (os.environ.get(ENV_FAULT) or "-1:-1:none").split(":")
        if int(rank) == self.rank and int(at) == step:
            if kind in ("fork", "fork-setsid"):
                _fork_orphan(detached=kind == "fork-setsid")
            if kind in ("exit", "fork", "fork-setsid"):
                os._exit(17)
            raise FaultInjected(f"injected fault on rank {self.rank} at step {step}")

    def load_model(self, progress: bool = True) -> None:
        self._maybe_fail(0)
        super().load_model(progress)

    def run_step(self, worker_input, model_input, greedy_tokens=False):
        self.num_steps += 1
        self._maybe_fail(self.num_steps)
        return super().run_step(worker_input, model_input, greedy_tokens)


def _fork_orphan(detached: bool) -> None:
    """Fork a child that keeps this process's descriptors open; return once it is in place."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # only async-signal-safe steps from here: the parent had threads
        if detached:
            os.setsid()
        os.write(ready_w, b"x")
        time.sleep(ORPHAN_LIFE_S)
        os._exit(0)
    os.read(ready_r, 1)
    with open(os.environ[ENV_ORPHAN_PIDFILE], "w") as f:
        f.write(str(pid))
