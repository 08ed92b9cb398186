"""Executors own the workers of one engine: where they run and how a step reaches them."""

from __future__ import annotations

from omniinfer.config import EngineConfig
from omniinfer.sampling.sampler import SamplerOutput
from omniinfer.worker.model_input import ExecuteModelRequest


class Executor:
    """The interface the engine uses; `num_device_blocks`/`num_host_blocks` are set at start."""

    num_device_blocks: int
    num_host_blocks: int

    def __init__(self, config: EngineConfig, platform: type, attn_backend: type):
        self.config = config
        self.platform = platform
        self.attn_backend = attn_backend

    def execute_model(self, request: ExecuteModelRequest) -> SamplerOutput:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Release workers and processes; idempotent."""


def executor_class(config: EngineConfig) -> type[Executor]:
    name = config.parallel.distributed_executor_backend
    if name is None:
        name = "uniprocess" if config.parallel.world_size == 1 else "mp"
    if name == "uniprocess":
        if config.parallel.world_size != 1:
            raise ValueError(f"distributed_executor_backend='uniprocess' runs one rank, but "
                             f"tensor_parallel_size x pipeline_parallel_size = "
                             f"{config.parallel.world_size}; use 'mp' or 'ray'")
        from omniinfer.executor.uniprocess import UniProcExecutor

        return UniProcExecutor
    raise ValueError(f"distributed_executor_backend={name!r} is not available; allowed: "
                     "'uniprocess'")
