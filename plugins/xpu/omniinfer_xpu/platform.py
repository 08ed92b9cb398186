"""Intel GPUs through upstream torch.xpu (no Intel extension required)."""

from __future__ import annotations

from omniinfer.platforms.interface import Availability, Platform, accelerator_kv_budget


class XpuPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    priority = 90
    dist_backend = "xccl"
    attention_backend_preferences = ("IPEX", "TRITON", "TORCH_SDPA", "REFERENCE")
    supported_dtypes = ("float16", "bfloat16", "float32")

    @classmethod
    def is_available(cls) -> Availability:
        import torch

        xpu = getattr(torch, "xpu", None)
        if xpu is None:
            return Availability(False, f"torch {torch.__version__} has no torch.xpu module")
        if not xpu.is_available():
            return Availability(False, f"torch {torch.__version__} sees no Intel GPU "
                                       "(torch.xpu.is_available() is False)")
        return Availability(True, f"{xpu.device_count()} Intel GPU(s)")

    @classmethod
    def build_info(cls) -> str:
        import torch

        version = getattr(torch.version, "xpu", None)
        return f"xpu {version}" if version else ""

    @classmethod
    def device_names(cls) -> list[str]:
        import torch

        return [torch.xpu.get_device_name(i) for i in range(torch.xpu.device_count())]

    @classmethod
    def device_count(cls) -> int:
        import torch

        return torch.xpu.device_count()

    @classmethod
    def set_device(cls, local_rank: int) -> None:
        import torch

        torch.xpu.set_device(local_rank)

    @classmethod
    def synchronize(cls) -> None:
        import torch

        torch.xpu.synchronize()

    @classmethod
    def pin_memory_available(cls) -> bool:
        return True

    @classmethod
    def kv_cache_memory_bytes(cls, config, model_bytes: int) -> int:
        import torch

        torch.xpu.synchronize()
        if hasattr(torch.xpu, "mem_get_info"):
            free, total = torch.xpu.mem_get_info()
        else:
            total = torch.xpu.get_device_properties(0).total_memory
            free = total - torch.xpu.memory_reserved()
        return accelerator_kv_budget(config, free, total)
