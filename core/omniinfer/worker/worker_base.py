"""Workers: one per rank. The driver (rank 0) turns the scheduler's plain data into the step's
tensors on the CPU and, when there are other ranks, broadcasts them in ONE tensor dict; every
rank then runs the same cache operations and forward pass on its own device. The driver also
samples, and drafts tokens with a draft model when speculative decoding is on."""

from __future__ import annotations

import torch

from omniinfer.attention.backend import AttentionBackend
from omniinfer.config import EngineConfig
from omniinfer.distributed import parallel_state as ps
from omniinfer.distributed.communication import broadcast_tensor_dict
from omniinfer.logger import init_logger
from omniinfer.models.intermediate import IntermediateTensors
from omniinfer.step import ModelRunnerOutput, SchedulerOutput
from omniinfer.worker.cache_engine import CacheEngine, block_bytes
from omniinfer.worker.model_input import ModelInput, WorkerInput

logger = init_logger(__name__)


class LocalOrDistributedWorkerBase:
    """The per-step protocol shared by every worker; subclasses own device and model set-up."""

    config: EngineConfig
    is_driver: bool
    world_size: int
    device: torch.device
    model_runner: object
    cache_engine: CacheEngine | None
    proposer: object = None  # the driver's DraftProposer (speculative decoding)

    def execute_worker(self, worker_input: WorkerInput) -> None:
        """Cache operations before the forward pass: swap out, copy-on-write, swap in (in that
        order: the scheduler may swap out a block that a copy then overwrites)."""
        if worker_input.blocks_to_swap_out.numel():
            self.cache_engine.swap_out(worker_input.blocks_to_swap_out)
        if worker_input.blocks_to_copy.numel():
            self.cache_engine.copy(worker_input.blocks_to_copy.to(self.device))
        if worker_input.window_blocks_to_copy.numel():
            self.cache_engine.copy(worker_input.window_blocks_to_copy.to(self.device), window=True)
        if worker_input.blocks_to_swap_in.numel():
            self.cache_engine.swap_in(worker_input.blocks_to_swap_in)

    def execute_model(self, sched: SchedulerOutput) -> list[ModelRunnerOutput]:
        """Driver only: prepare the step on the CPU, broadcast it once (world size > 1), run
        this rank's part, sample; one ModelRunnerOutput per step. With `sched.num_steps` > 1
        (plain decodes only) the later steps' inputs are built at once (`decode_step_inputs`),
        each takes the tokens the step before sampled, and each is broadcast and run like any
        other step. A step whose every sequence takes its plain greedy token (one rank) gets its
        tokens straight from the LM head (`ModelRunner.tokens_from_lm_head`), with no logits."""
        runner, proposer = self.model_runner, self.proposer
        for seq_id in runner.update_states(sched):  # finished, or preempted: held state is stale
            if proposer is not None:
                proposer.forget(seq_id)
        drafts = None if proposer is None else proposer.propose(sched, runner.states)
        worker_input = WorkerInput.from_schedule(sched)
        inputs = runner.decode_step_inputs(runner.prepare_model_input(sched, drafts), sched.num_steps)
        outputs, tokens = [], None
        for step, model_input in enumerate(inputs):
            if step:  # plain decodes draw one token each: the sampler hands them over as a tensor
                model_input.input_tokens = tokens
                worker_input = WorkerInput.nothing()  # the cache operations ran with step 0
            if self.world_size > 1:
                broadcast_tensor_dict({**worker_input.as_broadcastable_tensor_dict(),
                                       **model_input.as_broadcastable_tensor_dict()}, src=0)
            greedy = runner.tokens_from_lm_head(model_input)
            out = self.run_step(worker_input, model_input, greedy_tokens=greedy)  # tokens or logits
            output, tokens = runner.sample(out, model_input, greedy)
            outputs.append(output)
        if proposer is not None:
            proposer.after_step(outputs[0])
        return outputs

    def receive_step(self) -> tuple[WorkerInput, ModelInput] | None:
        """Other ranks: the next step from the driver's broadcast; None for the stop signal."""
        values = broadcast_tensor_dict(None, src=0)
        if not values:
            return None
        metadata_cls = self.model_runner.attn_backend.get_builder_cls().metadata_cls
        return (WorkerInput.from_broadcasted_tensor_dict(values),
                ModelInput.from_broadcasted_tensor_dict(values, metadata_cls))

    def start_worker_execution_loop(self) -> None:
        """Other ranks: run every step the driver broadcasts until it broadcasts the stop signal.
        They never see a sequence object."""
        while (step := self.receive_step()) is not None:
            self.run_step(*step)

    def stop_worker_execution_loop(self) -> None:
        """Driver: tell the other ranks' loops to return (an empty dict is the stop signal)."""
        if self.world_size > 1:
            broadcast_tensor_dict({}, src=0)

    def run_step(self, worker_input: WorkerInput, model_input: ModelInput,
                 greedy_tokens: bool = False) -> torch.Tensor | None:
        """Every rank: cache operations, then this stage's layers. With pipeline parallelism
        the hidden states and residual go stage to stage and the last stage's TP rank 0 sends
        the logits back to the driver. Returns the logits on the driver (`greedy_tokens`, one
        rank only: the greedy tokens), None elsewhere."""
        self.execute_worker(worker_input)
        device_input = model_input.to(self.device)
        m = self.config.model
        pp_size, pp_rank = ps.get_pp_size(), ps.get_pp_rank()
        intermediate = None
        if pp_rank > 0:
            shape = (model_input.num_tokens, m.hidden_size)
            hidden, residual = ps.pp_recv([shape, shape], m.dtype, self.device, pp_rank - 1)
            intermediate = IntermediateTensors({"hidden_states": hidden, "residual": residual})
        out = self.model_runner.execute_model(device_input, self.cache_engine.device_cache,
                                              intermediate, greedy_tokens)
        if pp_size == 1:
            return out if self.is_driver else None
        if pp_rank < pp_size - 1:
            ps.pp_send([out["hidden_states"], out["residual"]], pp_rank + 1)
        elif ps.get_tp_rank() == 0:
            ps.pp_send([out], 0)
        if not self.is_driver:
            return None
        rows = model_input.logits_indices.shape[0]
        return ps.pp_recv([(rows, m.vocab_size)], m.dtype, self.device, pp_size - 1)[0]


class Worker(LocalOrDistributedWorkerBase):
    """A worker on one device of the selected platform."""

    def __init__(self, config: EngineConfig, platform: type, attn_backend: type[AttentionBackend],
                 rank: int = 0, local_rank: int = 0, is_driver: bool = True,
                 distributed_init_method: str | None = None):
        self.config = config
        self.platform = platform
        self.attn_backend = attn_backend
        self.rank = rank
        self.local_rank = local_rank
        self.is_driver = is_driver
        self.world_size = config.parallel.world_size
        self.distributed_init_method = distributed_init_method  # "tcp://host:port" (world > 1)
        self.device = platform.device(local_rank)
        self.model_runner = None
        self.cache_engine = None
        self.owns_process_groups = False  # this worker joined them (and leaves them at shutdown)

    def init_device(self) -> None:
        """Bind the device; with several ranks, join the process groups (every rank at once)."""
        self.platform.set_device(self.local_rank)
        if self.world_size > 1:
            p = self.config.parallel
            ps.init_distributed_environment(self.rank, self.world_size,
                                            self.distributed_init_method,
                                            self.platform.dist_backend)
            self.owns_process_groups = True
            ps.initialize_model_parallel(p.tensor_parallel_size, p.pipeline_parallel_size)
        self.model_runner = self.platform.model_runner_cls()(
            self.config, self.attn_backend, self.device, is_driver=self.is_driver,
            platform=self.platform)

    def load_model(self, progress: bool = True) -> None:
        self.model_runner.load_model(progress=progress)
        if self.config.speculative is not None and self.is_driver:
            from omniinfer.attention.selector import backend_for_model
            from omniinfer.spec_decode.proposer import DraftProposer

            backend = backend_for_model(self.platform, self.config.speculative.draft, self.config)
            self.proposer = DraftProposer(self.config, self.platform, backend, self.device, progress)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads on this rank (one, replicated, when there are fewer KV heads than TP ranks)."""
        return max(1, self.config.model.num_kv_heads // self.config.parallel.tensor_parallel_size)

    def block_bytes(self) -> int:
        m = self.config.model
        return block_bytes(self.model_runner.num_local_layers, self.config.cache.block_size,
                           self.num_local_kv_heads, m.head_size, m.dtype)

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
        from omniinfer.attention.layer import Attention
        from omniinfer.kv_window import window_pool_plan

        m = self.config.model
        plan = window_pool_plan(self.config, self.attn_backend, num_device_blocks)
        windows = None
        if plan is not None:  # this stage's layers, in kv_caches order
            windows = [a.sliding_window for a in self.model_runner.model.modules() if isinstance(a, Attention)]
        self.cache_engine = CacheEngine(
            self.attn_backend, self.model_runner.num_local_layers, num_device_blocks,
            num_host_blocks, self.config.cache.block_size, self.num_local_kv_heads, m.head_size,
            m.dtype, self.device, pin_memory=self.platform.pin_memory_available(),
            layer_windows=windows, num_window_blocks=plan[1] if plan else 0)
        if self.proposer is not None:
            self.proposer.initialize_cache(num_device_blocks)

    def shutdown(self) -> None:
        """Leave the process groups (this process may start another engine afterwards)."""
        if self.owns_process_groups:
            self.owns_process_groups = False
            ps.destroy_distributed_environment()
