"""IPEX: intel-extension-for-pytorch's paged attention on Intel GPUs (used only when the
extension imports: it is retired upstream and pins an old torch)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import ClassVar

from omniinfer.attention.backend import AttentionSpec
from omniinfer.attention.backends.paged_ops import PagedOpsBackend, PagedOpsImpl

LIBRARY = "intel_extension_for_pytorch"


def library_error() -> str | None:
    if importlib.util.find_spec(LIBRARY) is None:
        return f"{LIBRARY} is not installed (pip install 'omniinfer-xpu[ipex]')"
    try:
        importlib.import_module(LIBRARY)
    except Exception as e:  # missing, or built for another torch
        return f"{LIBRARY} is not importable ({type(e).__name__}: {e})"
    return None


class IpexXpuImpl(PagedOpsImpl):
    def load_ops(self):
        return importlib.import_module(LIBRARY).llm.modules.PagedAttention


class IpexXpuBackend(PagedOpsBackend):
    name: ClassVar[str] = "IPEX"
    supported_device_types: ClassVar[tuple[str, ...]] = ("xpu",)

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        error = library_error()
        return [error] if error else []

    @classmethod
    def get_impl_cls(cls):
        return IpexXpuImpl
