"""Fault injection for the distributed tests: a worker that fails on purpose.

Select it with `worker_cls="omniinfer.testing.faults.FaultyWorker"` and describe the fault
in OMNIINFER_TEST_FAULT="RANK:STEP:KIND" (read in each worker's own process, so it reaches
spawned processes and Ray actors alike): on rank RANK, at its STEP-th step (from 1; 0 means
while loading the model), KIND "raise" raises FaultInjected, "exit" ends the process with
code 17.
"""

from __future__ import annotations

import os

from omniinfer.worker.worker_base import Worker

ENV_FAULT = "OMNIINFER_TEST_FAULT"


class FaultInjected(RuntimeError):
    pass


class FaultyWorker(Worker):
    num_steps = 0

    def _maybe_fail(self, step: int) -> None:
        rank, at, kind = (os.environ.get(ENV_FAULT) or "-1:-1:none").split(":")
        if int(rank) == self.rank and int(at) == step:
            if kind == "exit":
                os._exit(17)
            raise FaultInjected(f"injected fault on rank {self.rank} at step {step}")

    def load_model(self, progress: bool = True) -> None:
        self._maybe_fail(0)
        super().load_model(progress)

    def run_step(self, worker_input, model_input, greedy_tokens=False):
        self.num_steps += 1
        self._maybe_fail(self.num_steps)
        return super().run_step(worker_input, model_input, greedy_tokens)
