"""The vendor-neutral model runner: loads the model, builds inputs, runs the forward pass.

Device plugins subclass `ModelRunner` and override only what differs on their hardware
(threads, graph capture, a faster path for some step).
"""

from __future__ import annotations

import torch

from omniinfer.attention.backend import AttentionBackend
from omniinfer.config import EngineConfig
from omniinfer.engine.scheduler import ScheduledSeq
from omniinfer.models.intermediate import IntermediateTensors
from omniinfer.models.layers.decoder_stack import DecoderLayerSpec, DecoderStack
from omniinfer.models.layers.layer_ops import TORCH_LAYER_OPS, LayerOps, install_layer_ops
from omniinfer.models.layers.linear import LinearMethod, install_linear_methods
from omniinfer.models.loader import load_model
from omniinfer.sampling.sampler import Sampler, SamplerOutput
from omniinfer.worker.input_builder import ModelRunnerInputBuilder, is_decode, is_plain_decode
from omniinfer.worker.model_input import ModelInput


class ModelRunner:
    def __init__(self, config: EngineConfig, attn_backend: type[AttentionBackend],
                 device: torch.device, is_driver: bool = True):
        self.config = config
        self.model_config = config.model
        self.attn_backend = attn_backend
        self.device = device
        self.is_driver = is_driver
        self.block_size = config.cache.block_size
        self.model: torch.nn.Module | None = None
        self.sampler: Sampler | None = None

    # ---- set-up ----------------------------------------------------------------------------------
    def load_model(self, progress: bool = True) -> None:
        from omniinfer.platforms.registry import get_registry

        self.model = load_model(self.model_config, self.attn_backend, self.device, progress,
                                quant_kernels=get_registry().quant_kernels)
        install_linear_methods(self.model, self.linear_method)
        ops = self.layer_ops()
        if ops is not None:
            install_layer_ops(self.model, ops)
        specs = self.model.decoder_layer_specs() if hasattr(self.model, "decoder_layer_specs") else None
        if specs:
            self.model.decoder_stack = self.decoder_stack(specs)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.model_config.seed)
        self.sampler = Sampler(self.model_config.vocab_size, generator,
                               (ops or TORCH_LAYER_OPS).argmax_rows)

    def linear_method(self, layer: torch.nn.Module) -> LinearMethod | None:
        """This platform's `LinearMethod` for one linear layer or LM head of the loaded model, or
        None to keep torch's `F.linear`. Called once per layer, after the weights are loaded."""
        return None

    def layer_ops(self) -> LayerOps | None:
        """This platform's `LayerOps` (norm, rotary, activation, the greedy argmax) for the loaded
        model, or None to keep torch's."""
        return None

    def decoder_stack(self, layers: list[DecoderLayerSpec]) -> DecoderStack | None:
        """This platform's one-call forward of the loaded model's decoder layers (see
        models/layers/decoder_stack.py), or None to let the model run them one by one. Called once,
        after the linear methods and layer ops are installed."""
        return None

    def model_bytes(self) -> int:
        from omniinfer.quantization.loading import quantized_bytes

        real = sum(p.numel() * p.element_size() for p in self.model.parameters() if not p.is_meta)
        return real + quantized_bytes(self.model)

    @property
    def num_local_layers(self) -> int:
        return self.model.num_local_layers

    # ---- one step --------------------------------------------------------------------------------
    def make_builder(self) -> ModelRunnerInputBuilder:
        attn_builder = self.attn_backend.get_builder_cls()(self.block_size,
                                                           self.model_config.sliding_window)
        return ModelRunnerInputBuilder(attn_builder)

    def prepare_model_input(self, scheduled: list[ScheduledSeq],
                            block_tables: dict[int, list[int]]) -> ModelInput:
        """Driver only: the step's inputs, every tensor on the CPU (prefills first)."""
        builder = self.make_builder()
        plain, other_decodes = [], []
        for s in scheduled:
            if is_plain_decode(s):
                plain.append(s)
            elif is_decode(s):
                other_decodes.append(s)
            else:
                builder.add_seq(s, block_tables[s.seq.seq_id])  # prefills first
        for s in other_decodes:
            builder.add_seq(s, block_tables[s.seq.seq_id])
        if plain:
            builder.add_decodes(plain, block_tables)
        return builder.build()

    def decode_step_inputs(self, first: ModelInput, num_steps: int) -> list[ModelInput]:
        """Multi-step decoding: the inputs of `num_steps` steps of a batch of plain decodes, the
        first one's given. Each later step is the one before advanced by a token (positions + 1,
        the metadata one token ahead, in KV slots the scheduler reserved); its `input_tokens` are
        left for the step before to fill with what it samples.

        All built at once, on purpose: small tensor operations between two forward passes run
        with the caches full of weights, 5-10x slower than back to back (measured on the CPU:
        an advance of 64 decodes' metadata took 200 us there against 25 us here)."""
        inputs = [first]
        for _ in range(num_steps - 1):
            prev = inputs[-1]
            positions = prev.input_positions + 1
            metadata = prev.attn_metadata.clone()
            metadata.advance_step(positions, self.block_size)
            inputs.append(ModelInput(input_tokens=None, input_positions=positions,
                                     attn_metadata=metadata, logits_indices=prev.logits_indices,
                                     sampling_metadata=prev.sampling_metadata))
        return inputs

    @torch.inference_mode()
    def execute_model(self, model_input: ModelInput, kv_caches: list[torch.Tensor],
                      intermediate_tensors: IntermediateTensors | None = None,
                      greedy_tokens: bool = False) -> torch.Tensor | IntermediateTensors:
        """Logits of the rows that need them (last pipeline stage), else what the next stage needs.
        With `greedy_tokens` (see `tokens_from_lm_head`), those rows' greedy tokens instead."""
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
    def sample_tokens(self, tokens: torch.Tensor, model_input: ModelInput) -> SamplerOutput:
        """The SamplerOutput of a step whose tokens came from the LM head."""
        return self.sampler.greedy_output(tokens, model_input.sampling_metadata)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, model_input: ModelInput) -> SamplerOutput:
        return self.sampler(logits, model_input.sampling_metadata)
