"""Fixtures for the plugin tests: vendor libraries replaced by pure-torch stand-ins."""

from __future__ import annotations

import sys

import pytest
import vendor_fakes


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """fake_flash_attn(name="flash_attn", paged_block_multiple=256) installs a stand-in module."""

    def install(name: str = "flash_attn", paged_block_multiple: int = 256):
        for other in ("flash_attn", "vllm_flash_attn"):
            monkeypatch.setitem(sys.modules, other, None)  # None: "import fails"
        module = vendor_fakes.make_flash_attn(name, paged_block_multiple)
        monkeypatch.setitem(sys.modules, name, module)
        return module

    return install


@pytest.fixture
def no_flash_attn(monkeypatch):
    for name in ("flash_attn", "vllm_flash_attn"):
        monkeypatch.setitem(sys.modules, name, None)


@pytest.fixture
def fake_xformers(monkeypatch):
    modules = vendor_fakes.make_xformers()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return modules["xformers.ops"]


@pytest.fixture
def fake_ipex(monkeypatch):
    """fake_ipex(with_scales=True) installs a stand-in intel_extension_for_pytorch."""

    def install(with_scales: bool = True):
        module = vendor_fakes.make_ipex(with_scales)
        monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", module)
        monkeypatch.setattr("importlib.util.find_spec", _find_spec_with(module))
        return module

    return install


def _find_spec_with(module):
    import importlib.machinery
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == module.__name__:
            return importlib.machinery.ModuleSpec(name, None)
        return real(name, *args, **kwargs)

    return find_spec
