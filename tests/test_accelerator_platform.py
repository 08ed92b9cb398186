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
