"""One worker, in the engine's own process."""

from __future__ import annotations

from omniinfer.executor.base import Executor, resolve_worker_cls


class UniProcExecutor(Executor):
    def __init__(self, config, platform, attn_backend, progress: bool = True):
        super().__init__(config, platform, attn_backend)
        self.worker = resolve_worker_cls(config)(config, platform, attn_backend, rank=0,
                                                 local_rank=0, is_driver=True)
        self.worker.init_device()
        self.worker.load_model(progress=progress)
        self.num_device_blocks, self.num_host_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(self.num_device_blocks, self.num_host_blocks)

    def execute_model(self, sched):
        return self.worker.execute_model(sched)
