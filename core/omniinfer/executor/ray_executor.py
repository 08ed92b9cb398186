"""The `ray` executor: ranks 1..world-1 as Ray actors, placed with a placement group.

The driver (rank 0) stays in the engine's process. Ray is started locally when it is not
running (`ray.init()`, which joins the cluster named by RAY_ADDRESS if set); to use an
existing cluster call `ray.init(address=...)` before creating the engine. Bundle 0 (the
driver's share) is pinned to this node; the others are packed wherever Ray finds the
platform's `ray_resource` ("GPU", "CPU"...). Actors get this process's OMNIINFER_*
environment. A rank that raises or whose actor dies ends its loop's object ref; a thread
here watches those refs and fails the engine fast (see distributed.py).
"""

from __future__ import annotations

import os
import threading
import weakref

from omniinfer.executor.base import WorkerFailedError, resolve_worker_cls
from omniinfer.executor.distributed import DistributedExecutor, free_port

PLACEMENT_TIMEOUT_S = 60.0


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install "
                         "'omniinfer[ray]'") from e
    return ray


class RayWorker:
    """Hosts one rank's worker inside a Ray actor."""

    def __init__(self):
        self.worker = None

    def node_info(self) -> tuple[str, int, dict]:
        import ray

        return (ray.util.get_node_ip_address(), os.getpid(),
                ray.get_runtime_context().get_accelerator_ids())

    def init_worker(self, config, platform, attn_backend, rank: int, local_rank: int,
                    init_method: str) -> None:
        self.worker = resolve_worker_cls(config)(config, platform, attn_backend, rank=rank,
                                                 local_rank=local_rank, is_driver=False,
                                                 distributed_init_method=init_method)

    def execute_method(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)


def _actor_resources(resource: str) -> dict:
    if resource == "CPU":
        return {"num_cpus": 1}
    if resource == "GPU":
        return {"num_cpus": 0, "num_gpus": 1}
    return {"num_cpus": 0, "resources": {resource: 1}}


class RayExecutor(DistributedExecutor):
    def _start_workers(self) -> tuple[str, int]:
        ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init()
        resource = self.platform.ray_resource
        ip = ray.util.get_node_ip_address()
        bundles = [{resource: 1.0} for _ in range(self.world_size)]
        bundles[0][f"node:{ip}"] = 0.001  # the driver's share is on this node
        self._pg = placement_group(bundles, strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {self.world_size} ranks of {{{resource!r}: 1}} within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; cluster resources: {ray.cluster_resources()}, "
                f"available: {ray.available_resources()}")
        env = {k: v for k, v in os.environ.items() if k.startswith("OMNIINFER_")}
        actor_cls = ray.remote(RayWorker)
        self._actors = {
            rank: actor_cls.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=rank),
                runtime_env={"env_vars": env}, **_actor_resources(resource)).remote()
            for rank in range(1, self.world_size)}
        infos = {rank: self._result(rank, actor.node_info.remote())
                 for rank, actor in self._actors.items()}
        self._pids = [infos[rank][1] for rank in sorted(infos)]
        # Ray shows each actor only its own accelerator (local index 0); the driver takes
        # the first one on this node that no actor here holds.
        taken = {int(i) for node, _, ids in infos.values() if node == ip
                 for i in ids.get(resource, [])}
        driver_local_rank = 0
        if resource != "CPU":
            driver_local_rank = min(set(range(self.platform.device_count())) - taken, default=0)
        init_method = f"tcp://{ip}:{free_port('')}"
        refs = {rank: actor.init_worker.remote(self.config, self.platform, self.attn_backend,
                                               rank, 0, init_method)
                for rank, actor in self._actors.items()}
        for rank, ref in refs.items():
            self._result(rank, ref)
        return init_method, driver_local_rank

    @property
    def worker_pids(self) -> list[int]:
        return list(getattr(self, "_pids", []))

    def _pid_of(self, rank: int) -> int | None:
        pids = getattr(self, "_pids", [])
        return pids[rank - 1] if rank - 1 < len(pids) else None

    def _call_async(self, rank, method, args, kwargs):
        return self._actors[rank].execute_method.remote(method, *args, **kwargs)

    def _result(self, rank, ref):
        ray = self._ray
        while True:
            if self._failure is not None:
                self._raise_failure()
            ready, _ = ray.wait([ref], timeout=0.1)
            if not ready:
                continue
            try:
                return ray.get(ref)
            except Exception as e:
                raise WorkerFailedError(rank, _describe(e), self._pid_of(rank)) from e

    def _start_worker_loops(self) -> None:
        self._loops = {self._actors[rank].execute_method.remote("start_worker_execution_loop"): rank
                       for rank in self._actors}
        self._watcher = threading.Thread(target=_watch_loops, name="omniinfer-ray-watcher",
                                         args=(weakref.ref(self), self._ray, dict(self._loops)),
                                         daemon=True)
        self._watcher.start()

    def _kill_workers(self) -> None:
        for actor in getattr(self, "_actors", {}).values():
            self._ray.kill(actor, no_restart=True)

    def _stop_workers(self, timeout_s: float) -> None:
        ray = getattr(self, "_ray", None)
        if ray is None or not ray.is_initialized():
            return
        if getattr(self, "_loops", None):
            ray.wait(list(self._loops), num_returns=len(self._loops), timeout=timeout_s)
        self._kill_workers()
        if getattr(self, "_pg", None) is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._pg)
        if getattr(self, "_watcher", None) is not None:
            self._watcher.join(2.0)
        if self._owns_ray:
            ray.shutdown()


def _describe(e: Exception) -> str:
    cause = getattr(e, "cause", None)  # RayTaskError: the worker's own exception
    if isinstance(cause, BaseException):
        return f"raised {type(cause).__name__}: {cause}\n{e}"
    return f"died: {type(e).__name__}: {e}"


def _watch_loops(executor_ref, ray, loops: dict) -> None:
    """Watcher thread: a loop that returns while the engine runs is a failure."""
    pending = list(loops)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
        executor = executor_ref()
        if executor is None or executor._is_stopping:
            return
        for ref in done:
            try:
                ray.get(ref)
                cause = "left its execution loop without the stop signal"
            except Exception as e:
                cause = _describe(e)
            executor._worker_failed(loops[ref], cause, executor._pid_of(loops[ref]))
        del executor
