"""Intel GPUs through upstream torch.xpu (no Intel extension required)."""

from __future__ import annotations

from omniinfer.platforms.accelerator import AcceleratorPlatform
from omniinfer.platforms.interface import Availability


class XpuPlatform(AcceleratorPlatform):
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
