"""IPEX_CPU: intel-extension-for-pytorch's paged attention on x86 CPUs, preferred when the
extension imports (it is retired upstream and pins an old torch)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import ClassVar

import torch

from omniinfer.attention.backend import AttentionSpec
from omniinfer.attention.backends.paged_ops import PagedOpsBackend, PagedOpsImpl

LIBRARY = "intel_extension_for_pytorch"


def library_error() -> str | None:
    if importlib.util.find_spec(LIBRARY) is None:  # cheap: asked on every CPU engine start
        return f"{LIBRARY} is not installed (pip install 'omniinfer-cpu[ipex]')"
    try:
        importlib.import_module(LIBRARY)
    except Exception as e:  # built for another torch, most often
        return f"{LIBRARY} is not importable ({type(e).__name__}: {e})"
    return None


class IpexCpuImpl(PagedOpsImpl):
    slot_mapping_dtype: ClassVar[torch.dtype] = torch.int32  # the CPU kernel reads int32 slots

    def load_ops(self):
        return importlib.import_module(LIBRARY).llm.modules.PagedAttention


class IpexCpuBackend(PagedOpsBackend):
    name: ClassVar[str] = "IPEX_CPU"
    supported_device_types: ClassVar[tuple[str, ...]] = ("cpu",)

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        error = library_error()
        return [error] if error else []

    @classmethod
    def get_impl_cls(cls):
        return IpexCpuImpl
