"""Platform and attention-backend selection, with the hardware simulated.

torch's probes (`torch.version.cuda`, `torch.version.hip`, `torch.cuda.*`, `torch.xpu.*`) are
patched, so every vendor's detection runs here on a CPU-only machine through the real
in-tree plugins, loaded through their entry points.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import logging

import pytest
import torch

from omniinfer.attention.backend import AttentionBackend, AttentionSpec
from omniinfer.attention.backends.torch_sdpa import TorchSDPABackend
from omniinfer.attention.reference import ReferenceBackend
from omniinfer.attention.selector import ENV_BACKEND, select_attention_backend
from omniinfer.platforms.interface import Availability, Platform
from omniinfer.platforms.registry import (
    ENV_DEVICE,
    ENV_PLUGINS,
    PluginError,
    PluginRegistry,
    reset_registry,
)

IN_TREE = ("cpu", "cuda", "rocm", "xpu")
TORCH = "2.99.0+simulated"
CORE_BACKENDS = {"TORCH_SDPA": TorchSDPABackend, "REFERENCE": ReferenceBackend}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (ENV_PLUGINS, ENV_DEVICE, ENV_BACKEND):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def simulate(monkeypatch):
    """simulate(cuda=, hip=, num_gpus=, num_xpus=) patches torch's probes; default: CPU only."""

    def apply(*, cuda: str | None = None, hip: str | None = None, num_gpus: int = 0,
              num_xpus: int = 0) -> None:
        monkeypatch.setattr(torch.version, "cuda", cuda)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: num_gpus > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: num_gpus)
        monkeypatch.setattr(torch.xpu, "is_available", lambda: num_xpus > 0)
        monkeypatch.setattr(torch.xpu, "device_count", lambda: num_xpus)

    monkeypatch.setattr(torch, "__version__", TORCH)
    monkeypatch.setattr("omniinfer_cpu.platform.usable_cpus", lambda: 8)
    apply()
    return apply


@pytest.fixture
def registry(simulate) -> PluginRegistry:
    return PluginRegistry(only=",".join(IN_TREE))


def _line(name: str, verdict: str, reason: str) -> str:
    return f"  {name}: {verdict} - {reason} [plugin omniinfer-{name} {md.version(f'omniinfer-{name}')}]"


NOT_CUDA = f"torch {TORCH} is not a CUDA build"
NOT_ROCM = f"torch {TORCH} is not a ROCm build (torch.version.hip is None)"
NO_XPU = f"torch {TORCH} sees no Intel GPU (torch.xpu.is_available() is False)"
CPU_ONLY_REPORT = "\n".join([
    "installed platforms:",
    _line("cpu", "available", "8 usable CPU core(s)"),
    _line("cuda", "unavailable", NOT_CUDA),
    _line("rocm", "unavailable", NOT_ROCM),
    _line("xpu", "unavailable", NO_XPU),
])


def test_in_tree_plugins_load_through_their_entry_points():
    registry = PluginRegistry()
    assert [(r.name, r.distribution, r.is_loaded, r.error) for r in registry.records] == [
        (n, f"omniinfer-{n}", True, "") for n in IN_TREE]
    assert sorted(registry.platforms) == list(IN_TREE)


# ---- detection -----------------------------------------------------------------------------
def test_cuda_build_with_a_device_selects_cuda(registry, simulate):
    simulate(cuda="12.4", num_gpus=2)
    assert registry.availability()["cuda"] == Availability(True, "2 CUDA device(s), CUDA 12.4")
    assert registry.select_platform().name == "cuda"


def test_cuda_build_without_a_device_falls_back_to_cpu(registry, simulate):
    simulate(cuda="12.4")
    assert registry.availability()["cuda"] == Availability(
        False, "torch is a CUDA 12.4 build, but no CUDA device is visible "
               "(torch.cuda.is_available() is False)")
    assert registry.select_platform().name == "cpu"


def test_rocm_build_selects_rocm_not_cuda(registry, simulate):
    # a ROCm build answers torch.cuda.is_available() with True: only torch.version.hip tells
    simulate(hip="6.2.41133", num_gpus=1)
    verdicts = registry.availability()
    assert verdicts["rocm"] == Availability(True, "1 AMD GPU(s), HIP 6.2.41133")
    assert verdicts["cuda"] == Availability(
        False, f"torch {TORCH} is a ROCm (HIP 6.2.41133) build; the rocm plugin serves it")
    assert registry.select_platform().name == "rocm"


def test_rocm_build_without_a_gpu(registry, simulate):
    simulate(hip="6.2.41133")
    assert registry.availability()["rocm"] == Availability(
        False, "torch is a ROCm (HIP 6.2.41133) build, but no AMD GPU is visible")
    assert registry.select_platform().name == "cpu"


def test_xpu_selects_xpu(registry, simulate):
    simulate(num_xpus=1)
    assert registry.availability()["xpu"] == Availability(True, "1 Intel GPU(s)")
    assert registry.select_platform().name == "xpu"


def test_nothing_selects_cpu(registry):
    assert registry.availability() == {
        "cpu": Availability(True, "8 usable CPU core(s)"), "cuda": Availability(False, NOT_CUDA),
        "rocm": Availability(False, NOT_ROCM), "xpu": Availability(False, NO_XPU)}
    assert registry.select_platform().name == "cpu"
    assert registry.report() == CPU_ONLY_REPORT


def test_highest_priority_available_platform_wins(registry, simulate):
    simulate(cuda="12.4", num_gpus=1, num_xpus=1)
    assert registry.select_platform().name == "cuda"  # 100 > xpu 90 > cpu 0

    class Faster(Platform):
        name, device_type, priority = "faster", "cpu", 200

        @classmethod
        def is_available(cls):
            return Availability(True, "always")

    class Absent(Faster):
        name, priority = "absent", 500

        @classmethod
        def is_available(cls):
            return Availability(False, "not here")

    class Crashes(Faster):
        name, priority = "crashes", 900

        @classmethod
        def is_available(cls):
            raise OSError("driver exploded")

    registry.platforms.update(faster=Faster, absent=Absent, crashes=Crashes)
    assert registry.select_platform() is Faster
    assert registry.availability()["crashes"] == Availability(
        False, "detection raised OSError: driver exploded")


# ---- overrides -----------------------------------------------------------------------------
def test_device_argument_and_env_override_detection(registry, simulate, monkeypatch):
    simulate(cuda="12.4", num_gpus=1)
    assert registry.select_platform("cpu").name == "cpu"
    assert registry.select_platform(" CPU ").name == "cpu"
    monkeypatch.setenv(ENV_DEVICE, "cpu")
    assert registry.select_platform().name == "cpu"
    assert registry.select_platform("cuda").name == "cuda"  # the argument beats the environment


def test_forcing_an_unavailable_platform_lists_every_platform(registry):
    with pytest.raises(PluginError) as info:
        registry.select_platform("cuda")
    assert str(info.value) == (f"device='cuda' is installed but not available here: {NOT_CUDA}\n"
                               + CPU_ONLY_REPORT)


def test_forcing_an_unavailable_platform_through_the_env(registry, monkeypatch):
    monkeypatch.setenv(ENV_DEVICE, "xpu")
    with pytest.raises(PluginError) as info:
        registry.select_platform()
    assert str(info.value) == (f"OMNIINFER_DEVICE='xpu' is installed but not available here: "
                               f"{NO_XPU}\n" + CPU_ONLY_REPORT)


def test_forcing_an_uninstalled_platform_lists_every_platform(registry):
    with pytest.raises(PluginError) as info:
        registry.select_platform("tpu")
    assert str(info.value) == ("device='tpu' names a platform that is not installed (install the "
                               "omniinfer-tpu plugin?)\n" + CPU_ONLY_REPORT)


def test_no_available_platform(simulate):
    registry = PluginRegistry(only="cuda,xpu")
    with pytest.raises(PluginError) as info:
        registry.select_platform()
    assert str(info.value) == "\n".join([
        "no available platform; install omniinfer-cpu at least", "installed platforms:",
        _line("cuda", "unavailable", NOT_CUDA), _line("xpu", "unavailable", NO_XPU)])


# ---- attention backends --------------------------------------------------------------------
class Head128Backend(AttentionBackend):
    name = "HEAD128"
    supported_device_types = ("cpu",)
    supported_head_sizes = (128,)
    supports_sliding_window = False


class StubPlatform(Platform):
    name, device_type = "stub", "cpu"
    attention_backend_preferences = ("HEAD128", "TORCH_SDPA", "REFERENCE")


BACKENDS = {**CORE_BACKENDS, "HEAD128": Head128Backend}


def _spec(device_type: str = "cpu", head_size: int = 64, dtype: torch.dtype = torch.float32,
          **kwargs) -> AttentionSpec:
    return AttentionSpec(device_type=device_type, platform_name="test", dtype=dtype,
                         head_size=head_size, num_heads=8, num_kv_heads=2, block_size=16, **kwargs)


def _select(platform, spec, requested=None):
    return select_attention_backend(platform, spec, BACKENDS, requested).name


def test_first_usable_preference_wins(registry):
    assert _select(StubPlatform, _spec(head_size=128)) == "HEAD128"
    assert _select(StubPlatform, _spec(head_size=64)) == "TORCH_SDPA"
    assert _select(registry.platforms["cpu"], _spec()) == "TORCH_SDPA"
    # FLASH_ATTN, XFORMERS and TRITON are not in this set: the cuda platform falls through
    assert _select(registry.platforms["cuda"], _spec("cuda", dtype=torch.bfloat16)) == "TORCH_SDPA"


def test_a_named_backend_is_forced(monkeypatch):
    assert _select(StubPlatform, _spec(head_size=128), "reference") == "REFERENCE"
    monkeypatch.setenv(ENV_BACKEND, "REFERENCE")
    assert _select(StubPlatform, _spec(head_size=128)) == "REFERENCE"
    assert _select(StubPlatform, _spec(head_size=128), "torch_sdpa") == "TORCH_SDPA"  # argument wins


def test_a_named_backend_that_refuses_says_why(monkeypatch):
    with pytest.raises(ValueError) as info:
        _select(StubPlatform, _spec(sliding_window=32), "HEAD128")
    assert str(info.value) == ("attention_backend='HEAD128' cannot serve this configuration on stub: "
                               "head size 64 not supported (supports 128); sliding-window attention "
                               "not supported")


def test_an_unknown_backend_lists_installed_ones(monkeypatch):
    with pytest.raises(ValueError) as info:
        _select(StubPlatform, _spec(), "nope")
    assert str(info.value) == ("attention_backend='nope' is not an installed attention backend; "
                               "installed: HEAD128, REFERENCE, TORCH_SDPA")
    monkeypatch.setenv(ENV_BACKEND, "flash")
    with pytest.raises(ValueError, match=r"^OMNIINFER_ATTENTION_BACKEND='flash' is not an installed "
                                         r"attention backend; installed: HEAD128, REFERENCE, "
                                         r"TORCH_SDPA$"):
        _select(StubPlatform, _spec())


def test_when_nothing_fits_every_candidate_says_why(registry):
    with pytest.raises(ValueError) as info:
        _select(registry.platforms["cuda"], _spec("tpu", dtype=torch.float64))
    runs_on = "runs on cpu/cuda/xpu, not tpu; dtype float64 not supported (supports float32, bfloat16, float16)"
    assert str(info.value) == "\n".join([
        "no attention backend can serve this configuration on cuda (dtype float64, head size 64, "
        "device type tpu, block size 16); candidates:",
        "  FLASH_ATTN: not installed (no loaded plugin provides it)",
        "  XFORMERS: not installed (no loaded plugin provides it)",
        "  TRITON: not installed (no loaded plugin provides it)",
        f"  TORCH_SDPA: {runs_on}",
        f"  REFERENCE: {runs_on}",
    ])


# ---- the start-up log line -----------------------------------------------------------------
class _StopAfterSelection(Exception):
    pass


def test_engine_start_logs_the_selected_platform(tmp_path, monkeypatch):
    from omniinfer.config import EngineArgs
    from omniinfer.engine import llm_engine

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "vocab_size": 384, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))

    def stop(path, *_):  # selection and its log line come before the tokenizer: stop there
        raise _StopAfterSelection

    monkeypatch.setattr(llm_engine, "load_tokenizer", stop)
    omniinfer_log = logging.getLogger("omniinfer")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = seen.append
    omniinfer_log.addHandler(handler)
    level = omniinfer_log.level
    omniinfer_log.setLevel(logging.INFO)  # whatever OMNIINFER_LOG_LEVEL says
    reset_registry()
    try:
        with pytest.raises(_StopAfterSelection):
            llm_engine.LLMEngine(EngineArgs(model=str(tmp_path), device="cpu").create_engine_config())
        with pytest.raises(PluginError, match=r"^device='tpu' names a platform that is not installed"):
            llm_engine.LLMEngine(EngineArgs(model=str(tmp_path), device="tpu").create_engine_config())
    finally:
        omniinfer_log.removeHandler(handler)
        omniinfer_log.setLevel(level)
        reset_registry()
    infos = [r.getMessage() for r in seen if r.levelno == logging.INFO]
    version = md.version("omniinfer-cpu")
    from omniinfer_cpu.kernels import build

    backend = "CPU_PAGED" if build.load() else "TORCH_SDPA"  # TORCH_SDPA without a C compiler
    assert any(m.startswith(f"platform cpu (plugin omniinfer-cpu {version}), torch ")
               and f"; attention backend {backend}; dtype float32" in m for m in infos), infos
