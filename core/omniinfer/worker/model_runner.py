"""The vendor-neutral model runner: loads the model, builds inputs, runs the forward pass.

Platforms do not subclass it (plugin API 2): what differs is declared. `Platform.model_transform`
changes the loaded model (models/transform.py), `Platform.supports_graph_capture` turns on
decode graphs (worker/graph_runner.py), and the attention backend builds its own metadata.
"""

from __future__ import annotations

import torch

from omniinfer.attention.backend import AttentionBackend
from omniinfer.config import EngineConfig
from omniinfer.logger import init_logger
from omniinfer.models.intermediate import IntermediateTensors
from omniinfer.models.layers.layer_ops import TORCH_LAYER_OPS, install_layer_ops
from omniinfer.models.layers.linear import install_linear_methods
from omniinfer.models.layers.moe import install_moe_methods
from omniinfer.models.loader import load_model
from omniinfer.models.transform import ModelTransform
from omniinfer.sampling.metadata import SeqStates
from omniinfer.sampling.sampler import Sampler
from omniinfer.step import ModelRunnerOutput, SchedulerOutput
from omniinfer.worker import graph_runner
from omniinfer.worker.input_builder import Drafts, ModelRunnerInputBuilder
from omniinfer.worker.model_input import ModelInput

logger = init_logger(__name__)


class ModelRunner:
    captures_graphs = True  # False: never replays decode graphs (the draft model's runner)

    def __init__(self, config: EngineConfig, attn_backend: type[AttentionBackend],
                 device: torch.device, is_driver: bool = True, platform: type | None = None):
        self.config = config
        self.model_config = config.model
        self.attn_backend = attn_backend
        self.device = device
        self.is_driver = is_driver
        self.platform = platform
        self.block_size = config.cache.block_size
        self.attn_builder = attn_backend.get_builder_cls()(self.block_size, config.model.sliding_window)
        self.model: torch.nn.Module | None = None
        self.sampler: Sampler | None = None
        self.transform: ModelTransform | None = None
        self.graphs: graph_runner.DecodeGraphs | None = None
        self._graph_pool = None  # the memory pool every captured graph shares
        self.states = SeqStates()  # driver: the running sequences, as sampling sees them

    # ---- set-up ----------------------------------------------------------------------------------
    def model_transform(self) -> ModelTransform:
        from omniinfer.platforms.legacy import RunnerHooksTransform

        if RunnerHooksTransform.wanted(self):  # a plugin API 1.x runner subclass's own hooks
            return RunnerHooksTransform(self)
        declared = None if self.platform is None else self.platform.model_transform(
            self.config, self.attn_backend)
        return declared or ModelTransform()

    def load_model(self, progress: bool = True) -> None:
        from omniinfer.platforms.registry import get_registry

        self.transform = transform = self.model_transform()
        transform.before_load()
        self.model = load_model(self.model_config, self.attn_backend, self.device, progress,
                                quant_kernels=get_registry().quant_kernels)
        transform.after_load(self.model)
        install_linear_methods(self.model, transform.linear_method)
        if hasattr(transform, "moe_method"):  # (a 1.x runner's hooks have none)
            install_moe_methods(self.model, transform.moe_method)
        ops = transform.layer_ops()
        if ops is not None:
            install_layer_ops(self.model, ops)
        specs = self.model.decoder_layer_specs() if hasattr(self.model, "decoder_layer_specs") else None
        parts = frozenset().union(*(s.parts() for s in specs or ()))
        unknown = parts - getattr(transform, "decoder_stack_parts", frozenset())
        if specs and not unknown:
            self.model.decoder_stack = transform.decoder_stack(specs)
        elif type(transform).decoder_stack is not ModelTransform.decoder_stack:
            why = (f"its layers have {', '.join(sorted(unknown))}, which the platform's stack does not compute"
                   if specs else "tensor parallelism, layers other than Llama's, or sliding and full layers mixed")
            logger.info("decoder stack: not used for %s (%s): the layers run one by one",
                        self.model_config.architecture, why)
        transform.after_install(self.model)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.model_config.seed)
        self.sampler = Sampler(self.model_config.vocab_size, generator,
                               (ops or TORCH_LAYER_OPS).argmax_rows)
        self._set_up_graphs()

    def _set_up_graphs(self) -> None:
        declared = getattr(self.platform, "supports_graph_capture", False)
        if not self.captures_graphs or not (declared or isinstance(self, graph_runner.GraphRunnerMixin)):
            return
        reason = graph_runner.disabled_reason(self)
        if reason:
            logger.info("decode steps run eagerly: %s", reason)
            return
        self.graphs = graph_runner.DecodeGraphs(self)

    def capture_graph(self, fn):
        """Capture `fn` (a forward pass over static buffers) in a device graph through the CUDA
        graph API of torch's module for this device type; returns ``(replay, output)``."""
        api = torch.get_device_module(self.device.type)
        replay, out, self._graph_pool = graph_runner.capture_with(api, fn, self._graph_pool)
        return replay, out

    def model_bytes(self) -> int:
        from omniinfer.quantization.loading import quantized_bytes

        real = sum(p.numel() * p.element_size() for p in self.model.parameters() if not p.is_meta)
        return real + quantized_bytes(self.model)

    @property
    def num_local_layers(self) -> int:
        return self.model.num_local_layers

    # ---- one step --------------------------------------------------------------------------------
    def update_states(self, sched: SchedulerOutput) -> list[int]:
        """Driver only, once per schedule: the sequences' sampling state (see SeqStates.update)."""
        return self.states.update(sched)

    def prepare_model_input(self, sched: SchedulerOutput, drafts: Drafts | None = None) -> ModelInput:
        """Driver only: the step's inputs, every tensor on the CPU (prefills first)."""
        return ModelRunnerInputBuilder(self.attn_builder, self.block_size).build(sched, self.states, drafts)

    def decode_step_inputs(self, first: ModelInput, num_steps: int) -> list[ModelInput]:
        """Multi-step decoding: the inputs of `num_steps` steps of a batch of plain decodes, the
        first one's given. Each later step's batch is the one before one token ahead
        (`CommonAttentionMetadata.next_decode_step`, in KV slots the scheduler reserved), built
        by the backend as any batch is; its `input_tokens` are left for the step before to
        fill with what it samples.

        All built at once, on purpose: small tensor operations between two forward passes run
        with the caches full of weights, 5-10x slower than back to back (measured on the CPU:
        an advance of 64 decodes' metadata took 200 us there against 25 us here)."""
        inputs = [first]
        for _ in range(num_steps - 1):
            prev = inputs[-1]
            common = prev.common.next_decode_step()
            inputs.append(ModelInput(input_tokens=None, input_positions=common.positions,
                                     attn_metadata=self.attn_builder.build(common),
                                     logits_indices=prev.logits_indices,
                                     sampling_metadata=prev.sampling_metadata, common=common))
        return inputs

    @torch.inference_mode()
    def execute_model(self, model_input: ModelInput, kv_caches: list[torch.Tensor],
                      intermediate_tensors: IntermediateTensors | None = None,
                      greedy_tokens: bool = False) -> torch.Tensor | IntermediateTensors:
        """Logits of the rows that need them (last pipeline stage), else what the next stage needs.
        With `greedy_tokens` (see `tokens_from_lm_head`), those rows' greedy tokens instead. A
        decode-only step replays a graph where there are."""
        if self.graphs is not None:
            hidden = self.graphs.run(model_input, kv_caches, intermediate_tensors)
            if hidden is not None:
                return self.logits_or_tokens(hidden[model_input.logits_indices], greedy_tokens)
        hidden = self.model(model_input.input_tokens, model_input.input_positions, kv_caches,
                            model_input.attn_metadata, intermediate_tensors)
        if not self.model.is_last_stage:
            return hidden
        return self.logits_or_tokens(hidden[model_input.logits_indices], greedy_tokens)

    def logits_or_tokens(self, hidden: torch.Tensor, greedy_tokens: bool) -> torch.Tensor:
        """The logits of these rows, or (`greedy_tokens`) their greedy tokens, which the LM
        head's linear method may find without writing the logits (a model without
        `compute_greedy_tokens`: the argmax of its logits)."""
        if not greedy_tokens:
            return self.model.compute_logits(hidden)
        if hasattr(self.model, "compute_greedy_tokens"):
            return self.model.compute_greedy_tokens(hidden, self.sampler.argmax_rows)
        return self.sampler.argmax_rows(self.model.compute_logits(hidden)[:, : self.sampler.vocab_size])

    def tokens_from_lm_head(self, model_input: ModelInput) -> bool:
        """Whether this step's tokens may come straight from the LM head (one rank): every
        logits row samples one plain greedy token (no log-probs, penalties, min_tokens, drafts
        to verify or prompt log-probabilities)."""
        md = model_input.sampling_metadata
        return (md is not None and md.num_sampling_rows > 0 and not md.spec_rows
                and not md.prompt_rows and self.config.parallel.world_size == 1
                and model_input.logits_indices.shape[0] == md.num_sampling_rows
                and Sampler.greedy_only(md))

    @torch.inference_mode()
    def sample(self, out: torch.Tensor, model_input: ModelInput, greedy_tokens: bool = False
               ) -> tuple[ModelRunnerOutput, torch.Tensor | None]:
        """The step's output from its logits (or, `greedy_tokens`, from the tokens the LM head
        gave), and its tokens as a tensor when each sampling row drew one."""
        if greedy_tokens:
            return self.sampler.greedy_output(out, model_input.sampling_metadata), out
        return self.sampler(out, model_input.sampling_metadata)
