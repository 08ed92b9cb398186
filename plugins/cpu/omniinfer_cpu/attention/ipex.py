"""IPEX_CPU: intel-extension-for-pytorch's paged attention on x86 CPUs, preferred when the
extension imports (it is retired upstream and pins an old torch)."""

from __future__ import annotations

import importlib
from typing import ClassVar

import torch

from omniinfer.attention.backends.paged_ops import PagedOpsBackend, PagedOpsImpl

LIBRARY = "intel_extension_for_pytorch"


class IpexCpuImpl(PagedOpsImpl):
    slot_mapping_dtype: ClassVar[torch.dtype] = torch.int32  # the CPU kernel reads int32 slots

    def load_ops(self):
        return importlib.import_module(LIBRARY).llm.modules.PagedAttention


class IpexCpuBackend(PagedOpsBackend):
    name: ClassVar[str] = "IPEX_CPU"
    supported_device_types: ClassVar[tuple[str, ...]] = ("cpu",)
    library: ClassVar[str] = LIBRARY
    install_hint: ClassVar[str] = "pip install 'omniinfer-cpu[ipex]'"

    @classmethod
    def get_impl_cls(cls):
        return IpexCpuImpl
