"""A base for GPU-like platforms that torch exposes as a device module.

`torch.get_device_module(device_type)` answers device count, names, binding,
synchronisation and free memory the same way for every vendor torch supports, so a
vendor plugin subclasses `AcceleratorPlatform` and states only what differs: detection,
its toolkit version, its collective backend, its backends and runner.
"""

from __future__ import annotations

from omniinfer.platforms.interface import Platform, accelerator_kv_budget


class AcceleratorPlatform(Platform):
    @classmethod
    def device_module(cls):
        import torch

        return torch.get_device_module(cls.device_type)

    @classmethod
    def device_names(cls) -> list[str]:
        module = cls.device_module()
        return [module.get_device_name(i) for i in range(module.device_count())]

    @classmethod
    def device_count(cls) -> int:
        return cls.device_module().device_count()

    @classmethod
    def set_device(cls, local_rank: int) -> None:
        cls.device_module().set_device(local_rank)

    @classmethod
    def synchronize(cls) -> None:
        cls.device_module().synchronize()

    @classmethod
    def model_transform(cls, config, attn_backend):
        """Mixture-of-experts layers on the core's Triton fused-MoE kernel where triton runs
        on this device (models/layers/moe_triton.py); everything else as loaded."""
        from omniinfer.models.layers.moe_triton import TritonModelTransform

        return TritonModelTransform(cls.device_type)

    @classmethod
    def pin_memory_available(cls) -> bool:
        return True

    @classmethod
    def kv_cache_memory_bytes(cls, config, model_bytes: int) -> int:
        module = cls.device_module()
        module.synchronize()
        if hasattr(module, "mem_get_info"):
            free, total = module.mem_get_info()
        else:  # older device modules: total minus what torch holds
            total = module.get_device_properties(0).total_memory
            free = total - module.memory_reserved()
        return accelerator_kv_budget(config, free, total)
