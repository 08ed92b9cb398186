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
        threads = int(os.environ.get(ENV_THREADS) or usable_cpus())
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        logger.debug("CPU runner using %d threads", threads)
        super().load_model(progress)
