"""The CPU plugin's IPEX_CPU backend: preferred when intel-extension-for-pytorch imports,
refused with its reason otherwise (as here), and its forward path against a stand-in of
``ipex.llm.modules.PagedAttention`` (``test_contract_*``). CPU_PAGED: tests/plugins/cpu/test_cpu_kernels.py."""

from __future__ import annotations

import torch

from omniinfer.attention.backend import AttentionSpec
from omniinfer.attention.selector import select_attention_backend
from omniinfer.platforms.registry import PluginRegistry
from omniinfer.testing.conformance.cases import Case, assert_matches_reference, run_case
from omniinfer_cpu.attention.ipex import IpexCpuBackend
from omniinfer_cpu.kernels import build
from omniinfer_cpu.platform import CpuPlatform

CHUNKED = ((16, 16), (24, 5), (31, 2), (48, 1), (0, 7))


def cpu_spec(**kw):
    return AttentionSpec(device_type="cpu", platform_name="cpu", dtype=torch.float32, head_size=64,
                         num_heads=4, num_kv_heads=2, block_size=16, **kw)


def test_ipex_cpu_is_preferred_only_when_importable(fake_ipex):
    registry = PluginRegistry(only="cpu")
    assert CpuPlatform.attention_backend_preferences[0] == "IPEX_CPU"
    assert IpexCpuBackend.validate(cpu_spec()) == [
        "intel_extension_for_pytorch is not installed (pip install 'omniinfer-cpu[ipex]')"]
    fallback = "CPU_PAGED" if build.load() else "TORCH_SDPA"  # the compiled kernel, when it builds
    assert select_attention_backend(CpuPlatform, cpu_spec(), registry.backends).name == fallback
    fake_ipex()
    assert select_attention_backend(CpuPlatform, cpu_spec(), registry.backends).name == "IPEX_CPU"
    # no sliding window in the extension's kernels: the next preference serves Mistral
    assert select_attention_backend(CpuPlatform, cpu_spec(sliding_window=32),
                                    registry.backends).name == fallback


def test_contract_ipex_cpu_paged_attention(fake_ipex):
    module = fake_ipex()
    case = Case("chunked", CHUNKED, block_size=8)
    assert_matches_reference(run_case(IpexCpuBackend, case, "cpu", torch.float32), torch.float32)
    assert ("reshape_and_cache", torch.int32) in module.calls  # the CPU kernel's slot dtype
