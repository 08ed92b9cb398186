"""The ROCm plugin with no AMD GPU: selection on a simulated HIP build, ROCM_FLASH's forward
path with CK flash attention replaced by a stand-in (``test_contract_*``) and without it (the
core Triton kernels, interpreted here), and the HIP-graph runner."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omniinfer.attention.backend import AttentionSpec
from omniinfer.attention.selector import select_attention_backend
from omniinfer.platforms.registry import PluginRegistry
from omniinfer.testing.conformance.cases import Case, assert_matches_reference, run_case
from omniinfer.worker.model_runner import ModelRunner
from omniinfer_rocm.attention.rocm_flash import RocmFlashBackend
from omniinfer_rocm.platform import RocmPlatform

MIXED = ((0, 9), (13, 6), (32, 1), (5, 1), (17, 1))
CHUNKED = ((16, 16), (24, 5), (31, 2), (48, 1))


@pytest.fixture
def amd_gpu(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr("omniinfer.kernels.triton.unavailable_reasons", lambda device_type: [])


def rocm_spec(dtype=torch.bfloat16, platform="rocm"):
    return AttentionSpec(device_type="cuda", platform_name=platform, dtype=dtype, head_size=128,
                         num_heads=8, num_kv_heads=2, block_size=16)


def test_rocm_selects_rocm_flash_then_triton(amd_gpu):
    registry = PluginRegistry(only="cpu,cuda,rocm,xpu")
    platform = registry.select_platform()
    assert platform is RocmPlatform and registry.backends["ROCM_FLASH"] is RocmFlashBackend
    assert select_attention_backend(platform, rocm_spec(), registry.backends).name == "ROCM_FLASH"
    # float32: ROCM_FLASH is half precision only; the Triton kernels serve it
    assert select_attention_backend(platform, rocm_spec(torch.float32), registry.backends).name == "TRITON"
    # the CUDA plugin's backends see "cuda" devices too, and say why they stand aside
    assert "serves the cuda platform only, not rocm" in " ".join(
        registry.backends["FLASH_ATTN"].validate(rocm_spec()))


def test_rocm_flash_refusals(monkeypatch):
    assert RocmFlashBackend.validate(rocm_spec(torch.float32, platform="cuda")) == [
        "dtype float32 not supported (supports float16, bfloat16)",
        "serves the rocm platform only, not cuda",
        "TRITON_INTERPRET=1 makes triton interpret the kernels on the host; unset it to run them "
        "compiled on cuda",
    ]


def test_the_core_runner_replays_hip_graphs():
    assert RocmPlatform.model_runner_cls() is ModelRunner and RocmPlatform.supports_graph_capture


@pytest.mark.parametrize("case", [Case("mixed", MIXED), Case("chunked", CHUNKED, block_size=32),
                                  Case("window", MIXED, sliding_window=6, group=4)],
                         ids=["mixed", "chunked", "window"])
def test_contract_ck_flash_attn(fake_flash_attn, case):
    module = fake_flash_attn("flash_attn", 256)  # CK's flash_attn_varlen_func, same contract
    assert_matches_reference(run_case(RocmFlashBackend, case, "cpu", torch.float16), torch.float16)
    assert set(module.calls) == {("varlen", False)}


@pytest.mark.parametrize("case", [Case("mixed", MIXED), Case("window", CHUNKED, sliding_window=6)],
                         ids=["mixed", "window"])
def test_triton_prefill_without_ck(no_flash_attn, case):
    assert_matches_reference(run_case(RocmFlashBackend, case, "cpu", torch.float16), torch.float16)


@pytest.mark.parametrize("check", ["test_common_fields", "test_prefill_and_decode_parts",
                                   "test_single_stage_batches_are_their_own_part",
                                   "test_moves_and_round_trips", "test_multi_step_decode_metadata",
                                   "test_advance_built_decode_metadata",
                                   "test_builds_from_the_common_description"])
def test_builder_invariants_of_the_conformance_kit(check):
    from omniinfer.testing.conformance import test_metadata

    conformance = SimpleNamespace(backend=lambda name: RocmFlashBackend, device=torch.device("cpu"))
    getattr(test_metadata, check)(conformance, RocmFlashBackend.name)
