"""Workers: one per rank. The driver (rank 0) prepares each step on the CPU and, when there
are other ranks, broadcasts it to them in ONE tensor dict; every rank then runs the
same cache operations and forward pass on its own device."""

from __future__ import annotations

import torch

from omniinfer.attention.backend import AttentionBackend
from omniinfer.config import EngineConfig
from omniinfer.distributed.communication import broadcast_tensor_dict
from omniinfer.logger import init_logger
from omniinfer.sampling.sampler import SamplerOutput
from omniinfer.worker.cache_engine import CacheEngine, block_bytes
from omniinfer.worker.model_input import ExecuteModelRequest, ModelInput, WorkerInput

logger = init_logger(__name__)


class LocalOrDistributedWorkerBase:
    """The per-step protocol shared by every worker; subclasses own device and model set-up."""

    is_driver: bool
    world_size: int
    device: torch.device
    model_runner: object
    cache_engine: CacheEngine | None

    def prepare_worker_input(self, request: ExecuteModelRequest) -> WorkerInput:
        return WorkerInput.from_request(request)

    def execute_worker(self, worker_input: WorkerInput) -> None:
        """Cache operations before the forward pass: swap out, copy-on-write, swap in (in that
        order: the scheduler may swap out a block that a copy then overwrites)."""
        if worker_input.blocks_to_swap_out.numel():
            self.cache_engine.swap_out(worker_input.blocks_to_swap_out)
        if worker_input.blocks_to_copy.numel():
            self.cache_engine.copy(worker_input.blocks_to_copy.to(self.device))
        if worker_input.blocks_to_swap_in.numel():
            self.cache_engine.swap_in(worker_input.blocks_to_swap_in)

    def execute_model(self, request: ExecuteModelRequest | None = None) -> SamplerOutput | None:
        """Driver: prepare, broadcast (world size > 1), run, sample. Other ranks: pass `None`;
        they receive the step from the broadcast. Returns None on other ranks."""
        if self.is_driver:
            worker_input = self.prepare_worker_input(request)
            model_input = self.model_runner.prepare_model_input(request.scheduled, request.block_tables)
            if self.world_size > 1:
                broadcast_tensor_dict({**worker_input.as_broadcastable_tensor_dict(),
                                       **model_input.as_broadcastable_tensor_dict()}, src=0)
        else:
            values = broadcast_tensor_dict(None, src=0)
            worker_input = WorkerInput.from_broadcasted_tensor_dict(values)
            model_input = ModelInput.from_broadcasted_tensor_dict(
                values, self.model_runner.attn_backend.get_builder_cls().metadata_cls)
        self.execute_worker(worker_input)
        device_input = model_input.to(self.device)
        logits = self.model_runner.execute_model(device_input, self.cache_engine.device_cache)
        if not self.is_driver:
            return None
        return self.model_runner.sample(logits, device_input)


class Worker(LocalOrDistributedWorkerBase):
    """A worker on one device of the selected platform."""

    def __init__(self, config: EngineConfig, platform: type, attn_backend: type[AttentionBackend],
                 rank: int = 0, local_rank: int = 0, is_driver: bool = True):
        self.config = config
        self.platform = platform
        self.attn_backend = attn_backend
        self.rank = rank
        self.local_rank = local_rank
        self.is_driver = is_driver
        self.world_size = config.parallel.world_size
        self.device = platform.device(local_rank)
        self.model_runner = None
        self.cache_engine = None

    def init_device(self) -> None:
        self.platform.set_device(self.local_rank)
        self.model_runner = self.platform.model_runner_cls()(
            self.config, self.attn_backend, self.device, is_driver=self.is_driver)

    def load_model(self, progress: bool = True) -> None:
        self.model_runner.load_model(progress=progress)

    def block_bytes(self) -> int:
        m = self.config.model
        kv_heads = max(1, m.num_kv_heads // self.config.parallel.tensor_parallel_size)
        return block_bytes(self.model_runner.num_local_layers, self.config.cache.block_size,
                           kv_heads, m.head_size, m.dtype)

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, host blocks) this worker can hold."""
        cache = self.config.cache
        per_block = self.block_bytes()
        if cache.num_kv_blocks is not None:
            num_device = cache.num_kv_blocks
        else:
            budget = cache.kv_cache_memory_bytes or self.platform.kv_cache_memory_bytes(
                self.config, self.model_runner.model_bytes())
            num_device = budget // per_block
            if num_device < 1:
                raise ValueError(f"the KV-cache budget of {budget} bytes holds no block of "
                                 f"{per_block} bytes; raise kv_cache_memory_bytes")
        num_host = 0
        if self.config.scheduler.preemption_mode == "swap":
            num_host = int(cache.swap_space * (1 << 30)) // per_block
        return int(num_device), int(num_host)

    def initialize_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        m = self.config.model
        kv_heads = max(1, m.num_kv_heads // self.config.parallel.tensor_parallel_size)
        self.cache_engine = CacheEngine(
            self.attn_backend, self.model_runner.num_local_layers, num_device_blocks,
            num_host_blocks, self.config.cache.block_size, kv_heads, m.head_size, m.dtype,
            self.device, pin_memory=self.platform.pin_memory_available())
