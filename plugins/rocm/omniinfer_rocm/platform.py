"""AMD GPUs through torch's ROCm (HIP) build, which also answers to the "cuda" device type."""

from __future__ import annotations

from omniinfer.platforms.accelerator import AcceleratorPlatform
from omniinfer.platforms.interface import Availability


class RocmPlatform(AcceleratorPlatform):
    name = "rocm"
    device_type = "cuda"  # ROCm torch exposes HIP devices as torch.device("cuda")
    priority = 100
    dist_backend = "nccl"  # RCCL answers to the nccl backend name
    attention_backend_preferences = ("ROCM_FLASH", "TRITON", "TORCH_SDPA", "REFERENCE")
    supported_dtypes = ("float16", "bfloat16", "float32")
    supports_graph_capture = True  # decode steps replay CUDA graphs (HIP graphs on ROCm)

    @classmethod
    def is_available(cls) -> Availability:
        import torch

        if not torch.version.hip:
            return Availability(False, f"torch {torch.__version__} is not a ROCm build "
                                       "(torch.version.hip is None)")
        if not torch.cuda.is_available():
            return Availability(False, f"torch is a ROCm (HIP {torch.version.hip}) build, but no AMD "
                                       "GPU is visible")
        return Availability(True, f"{torch.cuda.device_count()} AMD GPU(s), HIP {torch.version.hip}")

    @classmethod
    def build_info(cls) -> str:
        import torch

        return f"hip {torch.version.hip}" if torch.version.hip else ""

    @classmethod
    def device_arch(cls) -> str | None:
        """e.g. "gfx942" (MI300) for device 0; None when unknown."""
        import torch

        if not torch.cuda.is_available():
            return None
        try:  # "gfx90a:sramecc+:xnack-": the target features follow a colon
            arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", None)
        except (AssertionError, RuntimeError):  # no HIP device behind torch after all
            return None
        return arch.split(":")[0] if arch else None
