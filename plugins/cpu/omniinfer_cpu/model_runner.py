"""The CPU model runner: the core runner, with the thread count settled before loading; after
loading, the CPU linear method (compiled kernel, oneDNN packed weights) for every linear layer
and the LM head, the compiled layer ops, the decoder layers as one compiled stack, and the
weights moved to huge pages."""

from __future__ import annotations

import os

import torch

from omniinfer.logger import init_logger
from omniinfer.platforms.host import available_memory_bytes, usable_cpus
from omniinfer.worker.model_runner import ModelRunner
from omniinfer_cpu.memory import move_to_huge_pages

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
        self._linear = None
        super().load_model(progress)
        self._weight_arena = move_to_huge_pages(self.model)

    def linear_method(self, layer: torch.nn.Module):
        from omniinfer_cpu.kernels import build
        from omniinfer_cpu.linear import DTYPE_CODES, CpuLinearMethod, should_pack

        if layer.weight.dtype not in DTYPE_CODES:
            return None
        if self._linear is None:
            kernels = build.load()  # logs once why not, when unavailable
            pack = should_pack(self.model, available_memory_bytes())
            self._linear = CpuLinearMethod(kernels, pack) if kernels is not None or pack else False
            if self._linear:
                logger.info("linear layers: %s, then %s", f"compiled kernel up to "
                            f"{self._linear.kernel_rows} rows" if kernels else "no compiled kernel",
                            ("omni_gemm (bfloat16) or oneDNN packed weights" if self._linear.gemm
                             else "oneDNN packed weights") if pack else "torch's F.linear")
        return self._linear or None

    def decoder_stack(self, layers):
        from omniinfer_cpu.decoder_stack import CpuDecoderStack, unsupported
        from omniinfer_cpu.kernels import build

        kernels = build.load()
        why = unsupported(kernels, layers)
        if why:
            logger.info("decoder layers run one by one: %s", why)
            return None
        return CpuDecoderStack(kernels, layers)

    def layer_ops(self):
        from omniinfer_cpu.kernels import build
        from omniinfer_cpu.layer_ops import CpuLayerOps

        kernels = build.load()
        return None if kernels is None else CpuLayerOps(kernels)
