"""The CPU model runner: the core runner, with the thread count settled before loading."""

from __future__ import annotations

import os

import torch

from omniinfer.logger import init_logger
from omniinfer.platforms.host import usable_cpus
from omniinfer.worker.model_runner import ModelRunner

logger = init_logger(__name__)
ENV_THREADS = "OMNIINFER_CPU_THREADS"


class CpuModelRunner(ModelRunner):
    def load_model(self, progress: bool = True) -> None:
        # ranks of a parallel run share the cores
        share = max(1, usable_cpus() // self.config.parallel.world_size)
        threads = int(os.environ.get(ENV_THREADS) or share)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        logger.debug("CPU runner using %d threads", threads)
        super().load_model(progress)
