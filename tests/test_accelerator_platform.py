"""The shared GPU-platform base: every primitive goes to torch's device module for its type."""

from __future__ import annotations

import types

import pytest
import torch

from omniinfer.platforms.accelerator import AcceleratorPlatform


class FakeModule(types.SimpleNamespace):
    pass


@pytest.fixture
def fake(monkeypatch):
    calls = []
    module = FakeModule(
        device_count=lambda: 2,
        get_device_name=lambda i: f"Fake GPU {i}",
        set_device=lambda i: calls.append(("set_device", i)),
        synchronize=lambda: calls.append(("synchronize",)),
        mem_get_info=lambda: (30 << 30, 40 << 30),
    )
    real = torch.get_device_module
    monkeypatch.setattr(torch, "get_device_module",
                        lambda device_type=None: module if device_type == "fake" else real(device_type))
    return module, calls


class FakePlatform(AcceleratorPlatform):
    name = "fake"
    device_type = "fake"


def test_primitives_use_the_device_module(fake, checkpoint_dir):
    module, calls = fake
    assert FakePlatform.device_count() == 2
    assert FakePlatform.device_names() == ["Fake GPU 0", "Fake GPU 1"]
    FakePlatform.set_device(1)
    assert calls == [("set_device", 1)]
    from omniinfer.config import EngineArgs

    config = EngineArgs(model=checkpoint_dir("llama")).create_engine_config()
    budget = FakePlatform.kv_cache_memory_bytes(config, model_bytes=0)
    # 0.9 of 40 GiB, minus the 10 GiB already used, minus the activation/logits reserve
    assert 25 << 30 < budget < 26 << 30
    assert ("synchronize",) in calls
    assert FakePlatform.pin_memory_available()


def test_gpu_memory_utilization_sets_the_share(fake, checkpoint_dir, monkeypatch):
    """vLLM's --gpu-memory-utilization: the engine argument, over the environment variable; a
    plain Platform on a device type whose module reports memory gets the same budget."""
    from omniinfer.config import EngineArgs
    from omniinfer.platforms.interface import Availability, Platform

    monkeypatch.setenv("OMNIINFER_GPU_MEMORY_UTILIZATION", "0.9")
    base = EngineArgs(model=checkpoint_dir("llama")).create_engine_config()
    half = EngineArgs(model=checkpoint_dir("llama"), gpu_memory_utilization=0.5).create_engine_config()
    full, low = (FakePlatform.kv_cache_memory_bytes(c, model_bytes=0) for c in (base, half))
    assert full - low == int(0.9 * (40 << 30)) - int(0.5 * (40 << 30))  # 0.4 of 40 GiB less

    class Plain(Platform):  # implements nothing about memory
        name, device_type = "plain", "fake"

        @classmethod
        def is_available(cls):
            return Availability(True, "")

    assert Plain.kv_cache_memory_bytes(half, model_bytes=0) == low
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 is not allowed; it must be "
                                         r"in \(0, 1\]"):
        EngineArgs(model=checkpoint_dir("llama"), gpu_memory_utilization=1.5).create_engine_config()


def test_a_quantized_model_keeps_room_for_its_dequantised_weight(fake, checkpoint_dir):
    """Past a few rows the Triton layers dequantise a weight (at most 256 MiB at once, at most one
    rank's largest layer): the KV cache of a quantized model is smaller by that."""
    from omniinfer.config import EngineArgs
    from omniinfer.platforms.interface import dequant_workspace_bytes

    float_config = EngineArgs(model=checkpoint_dir("llama")).create_engine_config()
    int8_config = EngineArgs(model=checkpoint_dir("llama"), quantization="int8").create_engine_config()
    m = int8_config.model
    largest = max(2 * m.hf_config["intermediate_size"], m.vocab_size) * m.hidden_size * m.dtype_bytes
    assert dequant_workspace_bytes(float_config) == 0 and dequant_workspace_bytes(int8_config) == largest
    assert (FakePlatform.kv_cache_memory_bytes(float_config, model_bytes=0)
            - FakePlatform.kv_cache_memory_bytes(int8_config, model_bytes=0)) == largest

    def llama3_8b(tp):
        model = types.SimpleNamespace(quantization="gguf", hf_config={"intermediate_size": 14336},
                                      hidden_size=4096, vocab_size=128256, dtype_bytes=2)
        return types.SimpleNamespace(model=model, parallel=types.SimpleNamespace(tensor_parallel_size=tp))

    assert dequant_workspace_bytes(llama3_8b(1)) == 256 << 20  # (its LM head: 1 GiB in bfloat16)
    assert dequant_workspace_bytes(llama3_8b(8)) == 128256 * 4096 * 2 // 8  # the LM head's rank
