"""The CPU plugin's model transform (the platform's one load-time hook, models/transform.py):
the thread count settled before loading; after loading, the CPU linear method (compiled kernel,
packed and coded copies of the weights) for every linear layer and the LM head, the compiled
mixture-of-experts kernel for every MoE layer, the compiled layer ops, the decoder layers as one
compiled stack, and the weights moved to huge pages.

Everything it makes lives here and in the objects it installs (each layer's `CpuLinearMethod`
holds that layer's copies; the stack holds its structs): nothing is added to the core's layers.
"""

from __future__ import annotations

import os

import torch

from omniinfer.logger import init_logger
from omniinfer.models.transform import ModelTransform
from omniinfer.platforms.host import available_memory_bytes, usable_cpus

logger = init_logger(__name__)
ENV_THREADS = "OMNIINFER_CPU_THREADS"


class CpuModelTransform(ModelTransform):
    # decoder_stack.c: Qwen3's q_norm / k_norm; sparse layers on the experts' one-call step
    decoder_stack_parts = frozenset({"head_norms", "experts"})

    def __init__(self, config, attn_backend):
        self.config = config
        self.attention = attn_backend.name
        self.kernels = None
        self.pack = False
        self.weight_arena = None  # the huge-page mapping the weights live in (kept alive here)

    def before_load(self) -> None:
        # ranks of a parallel run share the cores
        share = max(1, usable_cpus() // self.config.parallel.world_size)
        threads = int(os.environ.get(ENV_THREADS) or share)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        logger.debug("CPU runner using %d threads", threads)

    def after_load(self, model) -> None:
        from omniinfer_cpu.kernels import build
        from omniinfer_cpu.linear import KERNEL_ROWS, MAX_ROWS, should_pack

        self.kernels = build.load()  # logs once why not, when unavailable
        self.pack = should_pack(model, available_memory_bytes())
        if self.kernels is not None or self.pack:
            logger.info("linear layers: %s, then %s", f"compiled kernel up to "
                        f"{KERNEL_ROWS if self.pack else MAX_ROWS} rows" if self.kernels
                        else "no compiled kernel", "omni_gemm or oneDNN packed weights" if self.pack
                        else "torch's F.linear")

    def linear_method(self, layer):
        from omniinfer_cpu.linear import DTYPE_CODES, CpuLinearMethod

        if layer.weight.dtype not in DTYPE_CODES or (self.kernels is None and not self.pack):
            return None
        return CpuLinearMethod(self.kernels, self.pack)

    def moe_method(self, layer):
        from omniinfer_cpu.linear import DTYPE_CODES
        from omniinfer_cpu.moe import CpuMoEMethod

        if self.kernels is None or layer.w13_weight.dtype not in DTYPE_CODES:
            return None
        return CpuMoEMethod(self.kernels)

    def layer_ops(self):
        from omniinfer_cpu.layer_ops import CpuLayerOps

        return None if self.kernels is None else CpuLayerOps(self.kernels)

    def decoder_stack(self, layers):
        from omniinfer_cpu.decoder_stack import CpuDecoderStack, unsupported

        why = unsupported(self.kernels, layers, self.attention)
        if why:
            logger.info("decoder layers run one by one: %s", why)
            return None
        return CpuDecoderStack(self.kernels, layers)

    def after_install(self, model) -> None:
        from omniinfer.heap import release_freed_memory
        from omniinfer_cpu.memory import move_to_huge_pages

        self.weight_arena = move_to_huge_pages(model)
        release_freed_memory()
