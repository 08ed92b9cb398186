"""IPEX: intel-extension-for-pytorch's paged attention on Intel GPUs (used only when the
extension imports: it is retired upstream and pins an old torch)."""

from __future__ import annotations

import importlib
from typing import ClassVar

from omniinfer.attention.backends.paged_ops import PagedOpsBackend, PagedOpsImpl

LIBRARY = "intel_extension_for_pytorch"


class IpexXpuImpl(PagedOpsImpl):
    def load_ops(self):
        return importlib.import_module(LIBRARY).llm.modules.PagedAttention


class IpexXpuBackend(PagedOpsBackend):
    name: ClassVar[str] = "IPEX"
    supported_device_types: ClassVar[tuple[str, ...]] = ("xpu",)
    library: ClassVar[str] = LIBRARY
    install_hint: ClassVar[str] = "pip install 'omniinfer-xpu[ipex]'"

    @classmethod
    def get_impl_cls(cls):
        return IpexXpuImpl
