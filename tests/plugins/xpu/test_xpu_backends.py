"""The XPU plugin with no Intel GPU: IPEX is refused with its reason when the extension is
absent, selected when present, and its forward path runs against a stand-in of
``ipex.llm.modules.PagedAttention`` (``test_contract_*``)."""

from __future__ import annotations

import pytest
import torch

from omniinfer.attention.backend import AttentionSpec
from omniinfer.attention.selector import select_attention_backend
from omniinfer.platforms.registry import PluginRegistry
from omniinfer.testing.conformance.cases import Case, assert_matches_reference, run_case
from omniinfer_xpu.attention.ipex import IpexXpuBackend

MIXED = ((0, 9), (13, 6), (32, 1), (5, 1), (17, 1))


@pytest.fixture
def intel_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)


def xpu_spec(**kw):
    return AttentionSpec(device_type="xpu", platform_name="xpu", dtype=torch.bfloat16, head_size=64,
                         num_heads=8, num_kv_heads=2, block_size=16, **kw)


def test_without_the_extension_ipex_says_why_and_triton_serves(intel_gpu, monkeypatch):
    monkeypatch.setattr("omniinfer.kernels.triton.unavailable_reasons", lambda device_type: [])
    registry = PluginRegistry(only="cpu,cuda,rocm,xpu")
    platform = registry.select_platform()
    assert platform.name == "xpu"
    assert IpexXpuBackend.validate(xpu_spec()) == [
        "intel_extension_for_pytorch is not installed (pip install 'omniinfer-xpu[ipex]')"]
    assert select_attention_backend(platform, xpu_spec(), registry.backends).name == "TRITON"


def test_with_the_extension_ipex_is_first(intel_gpu, fake_ipex):
    fake_ipex()
    registry = PluginRegistry(only="cpu,cuda,rocm,xpu")
    platform = registry.select_platform()
    assert select_attention_backend(platform, xpu_spec(), registry.backends).name == "IPEX"
    assert IpexXpuBackend.validate(xpu_spec(sliding_window=16)) == [
        "sliding-window attention not supported"]


@pytest.mark.parametrize("with_scales", [True, False], ids=["ipex-2.5+", "older"])
def test_contract_ipex_paged_attention(fake_ipex, with_scales):
    module = fake_ipex(with_scales)
    case = Case("mixed", MIXED, group=4)
    assert_matches_reference(run_case(IpexXpuBackend, case, "cpu", torch.float32), torch.float32)
    assert {c[0] for c in module.calls} == {"reshape_and_cache", "flash_attn_varlen_func",
                                            "single_query_cached_kv_attention"}
    assert ("reshape_and_cache", torch.int64) in module.calls
    assert IpexXpuBackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 2, 16, 64)
