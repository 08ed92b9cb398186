"""The CPU platform: always available, gloo for collectives, memory from the host."""

from __future__ import annotations

import os

from omniinfer.platforms.host import cpu_info, usable_cpus
from omniinfer.platforms.interface import Availability, Platform, host_kv_budget

GiB = 1 << 30
ENV_KV_CACHE = "OMNIINFER_CPU_KVCACHE_GIB"


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    priority = 0
    dist_backend = "gloo"
    attention_backend_preferences = ("IPEX_CPU", "CPU_PAGED", "TORCH_SDPA", "REFERENCE")
    supported_dtypes = ("float32", "bfloat16", "float16")
    ray_resource = "CPU"

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True, f"{usable_cpus()} usable CPU core(s)")

    @classmethod
    def device_names(cls) -> list[str]:
        info = cpu_info()
        return [f"{info['model'] or info['machine']} ({info['usable_cpus']} cores)"]

    @classmethod
    def runtime_info(cls) -> dict:
        """The ISA level of the kernels loaded, and which kernel families run (and why not)."""
        from omniinfer_cpu.report import kernel_report

        return kernel_report()

    @classmethod
    def max_local_ranks(cls) -> int | None:
        return None  # ranks share the cores (each gets usable_cpus() // world_size threads)

    @classmethod
    def model_transform(cls, config, attn_backend):
        from omniinfer_cpu.transform import CpuModelTransform

        return CpuModelTransform(config, attn_backend)

    @classmethod
    def auto_dtype(cls, checkpoint_dtype):
        """bfloat16 for a float16 checkpoint (as vLLM's CPU backend does): x86 CPUs here have no
        float16 arithmetic, so its products go through slow paths. Measured on a 2-core Zen 4
        (the medium shape, a 128-token prompt and 32 tokens, medians of 3): float16 3.63 s,
        bfloat16 0.97 s, float32 1.94 s; capped to AVX2 (the Zen 3 level) 3.57, 1.23, 1.78 s."""
        import torch

        return torch.bfloat16 if checkpoint_dtype == torch.float16 else checkpoint_dtype

    @classmethod
    def prompt_logits_bytes(cls) -> int | None:
        """256 MiB: 441 prompt tokens a step for a 151,936-token vocabulary. A prompt's logits are
        host memory here, and prefill steps of ~500 tokens run as fast as of 2048 (measured: a
        2040-token prompt with prompt_logprobs=1 on the medium q4_0 file took 8.6 s in 512-token
        steps against 8.9 in one, and grew the process by 510 MB against 1346)."""
        return 256 << 20

    @classmethod
    def kv_cache_memory_bytes(cls, config, model_bytes: int) -> int:
        """OMNIINFER_CPU_KVCACHE_GIB if set; else a quarter of available memory (shared by the
        ranks of a parallel run), at most 4 GiB, and never more than the running batch can use
        (max_num_seqs full-length sequences)."""
        if config.cache.gpu_memory_utilization is not None:  # a vLLM launch line's flag
            from omniinfer.logger import init_logger

            init_logger(__name__).info(
                "gpu_memory_utilization=%s is ignored on the CPU (host memory is shared with the "
                "rest of the machine): the KV cache is sized by kv_cache_memory_bytes or %s",
                config.cache.gpu_memory_utilization, ENV_KV_CACHE)
        if os.environ.get(ENV_KV_CACHE):
            return int(float(os.environ[ENV_KV_CACHE]) * GiB)
        return host_kv_budget(config, 4 * GiB)
