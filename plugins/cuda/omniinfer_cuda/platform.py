"""NVIDIA GPUs through torch's CUDA build."""

from __future__ import annotations

from omniinfer.platforms.accelerator import AcceleratorPlatform
from omniinfer.platforms.interface import Availability


class CudaPlatform(AcceleratorPlatform):
    name = "cuda"
    device_type = "cuda"
    priority = 100
    dist_backend = "nccl"
    attention_backend_preferences = ("FLASH_ATTN", "XFORMERS", "TRITON", "TORCH_SDPA", "REFERENCE")
    supported_dtypes = ("float16", "bfloat16", "float32")
    supports_graph_capture = True  # decode steps replay CUDA graphs (HIP graphs on ROCm)
    min_triton_capability = (7, 5)  # Triton 3 generates code for sm_75 and newer

    @classmethod
    def is_available(cls) -> Availability:
        import torch

        if torch.version.hip:
            return Availability(False, f"torch {torch.__version__} is a ROCm (HIP {torch.version.hip}) "
                                       "build; the rocm plugin serves it")
        if not torch.version.cuda:
            return Availability(False, f"torch {torch.__version__} is not a CUDA build")
        if not torch.cuda.is_available():
            return Availability(False, f"torch is a CUDA {torch.version.cuda} build, but no CUDA device "
                                       "is visible (torch.cuda.is_available() is False)")
        return Availability(True, f"{torch.cuda.device_count()} CUDA device(s), CUDA {torch.version.cuda}")

    @classmethod
    def build_info(cls) -> str:
        import torch

        return f"cuda {torch.version.cuda}" if torch.version.cuda and not torch.version.hip else ""

    @classmethod
    def device_capability(cls) -> tuple[int, int] | None:
        import torch

        return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None

    @classmethod
    def device_arch(cls) -> str | None:
        capability = cls.device_capability()
        return None if capability is None else f"sm_{capability[0]}{capability[1]}"


    @classmethod
    def verify_config(cls, config) -> list[str]:
        import torch

        reasons = super().verify_config(config)
        capability = cls.device_capability()
        if config.model.dtype == torch.bfloat16 and capability is not None and capability < (8, 0):
            reasons.append(f"bfloat16 needs compute capability 8.0 or newer; this GPU has "
                           f"{capability[0]}.{capability[1]} (use dtype='float16')")
        return reasons
