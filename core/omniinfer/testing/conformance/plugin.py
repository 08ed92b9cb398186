"""pytest hooks of the conformance kit: options, backend discovery, fixtures.

Loaded by the kit's ``conftest.py`` (``pytest --pyargs omniinfer.testing.conformance``), or with
``-p omniinfer.testing.conformance.plugin`` by a suite that collects the kit's test modules.

Backends come from the plugin registry: every backend the selected platform would consider
(its preferences, then any other installed backend for its device type). One that refuses the
platform's base configuration in every dtype is reported by ``test_backend_is_runnable`` as a
skip with its reasons; the others are what ``conformance_backend`` is parametrized over.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch

from omniinfer.attention.backend import AttentionBackend, AttentionSpec

ENV_PLATFORM = "OMNIINFER_DEVICE"
DTYPE_ORDER = (torch.float32, torch.bfloat16, torch.float16)  # float32 first: exact parity


@dataclass
class Conformance:
    """What this run tests: the platform, its device, and each backend's verdict."""

    platform: type
    device: torch.device
    runnable: dict[str, torch.dtype] = field(default_factory=dict)  # name -> dtype to test in
    refused: dict[str, list[str]] = field(default_factory=dict)  # name -> reasons
    classes: dict[str, type[AttentionBackend]] = field(default_factory=dict)  # as discovered

    def spec(self, dtype: torch.dtype, *, head_size: int = 64, num_heads: int = 4,
             num_kv_heads: int = 2, block_size: int = 16, sliding_window: int | None = None
             ) -> AttentionSpec:
        return self.platform.attention_spec(dtype=dtype, head_size=head_size, num_heads=num_heads,
                                            num_kv_heads=num_kv_heads, block_size=block_size,
                                            sliding_window=sliding_window)

    def backend(self, name: str) -> type[AttentionBackend]:
        return self.classes[name]


def discover(platform: type, only: list[str]) -> Conformance:
    from omniinfer.attention.selector import candidate_names
    from omniinfer.platforms.registry import get_registry

    registry = get_registry()
    platform.set_device(0)
    run = Conformance(platform, platform.device(0))
    dtypes = [d for d in DTYPE_ORDER if str(d).removeprefix("torch.") in platform.supported_dtypes]
    names = candidate_names(platform.attention_backend_preferences, registry.backends,
                            platform.device_type)
    wanted = [n.strip().upper() for n in only if n.strip()]
    unknown = [n for n in wanted if n not in registry.backends]
    if unknown:
        raise pytest.UsageError(f"--omniinfer-backend {', '.join(unknown)}: not installed; "
                                f"installed: {', '.join(sorted(registry.backends))}")
    for name in wanted or names:
        cls = registry.backends.get(name)
        if cls is None:
            run.refused[name] = ["not installed (no loaded plugin provides it)"]
            continue
        run.classes[name] = cls
        verdicts = {d: cls.validate(run.spec(d)) for d in dtypes}
        usable = [d for d, reasons in verdicts.items() if not reasons]
        if usable:
            run.runnable[name] = usable[0]
        else:
            run.refused[name] = [f"{str(d).removeprefix('torch.')}: {'; '.join(r)}"
                                 for d, r in verdicts.items()]
    return run


def pytest_addoption(parser) -> None:
    group = parser.getgroup("omniinfer", "omniinfer conformance kit")
    group.addoption("--omniinfer-platform", default=None,
                    help=f"platform to test (default: ${ENV_PLATFORM}, else the best available)")
    group.addoption("--omniinfer-backend", action="append", default=[],
                    help="test only this attention backend (repeatable)")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: longer tests")
    from omniinfer.platforms.registry import get_registry

    # options are missing when this runs from the package's conftest after parsing (--pyargs)
    name = config.getoption("--omniinfer-platform", default=None) or os.environ.get(ENV_PLATFORM)
    platform = get_registry().select_platform(name or None)
    if platform.device_type == "cpu":
        # the core's Triton kernels run on CPU tensors only interpreted; decided at their import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    only = config.getoption("--omniinfer-backend", default=None) or []
    config._omniinfer_conformance = discover(platform, only)


def pytest_report_header(config) -> list[str]:
    run = getattr(config, "_omniinfer_conformance", None)
    if run is None:
        return []
    lines = [f"omniinfer conformance: platform {run.platform.name} ({run.platform.describe()}), "
             f"device {run.device}",
             "  runnable: " + (", ".join(f"{n} ({str(d).removeprefix('torch.')})"
                                         for n, d in run.runnable.items()) or "none")]
    lines += [f"  refused {n}: {' | '.join(r)}" for n, r in run.refused.items()]
    return lines


def pytest_generate_tests(metafunc) -> None:
    run = getattr(metafunc.config, "_omniinfer_conformance", None)
    if run is None:
        return
    if "conformance_backend" in metafunc.fixturenames:
        metafunc.parametrize("conformance_backend", list(run.runnable), ids=list(run.runnable))
    if "candidate_backend" in metafunc.fixturenames:
        names = list(run.runnable) + list(run.refused)
        metafunc.parametrize("candidate_backend", names, ids=names)


@pytest.fixture(scope="session")
def conformance(request) -> Conformance:
    return request.config._omniinfer_conformance


@pytest.fixture(scope="session")
def conformance_checkpoint(tmp_path_factory) -> str:
    """A tiny random Llama (GQA, initializer_range 0.1) with a real tokenizer."""
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("conformance") / "llama"), "llama")


@pytest.fixture(scope="session")
def transformers_greedy():
    """transformers_greedy(path, prompt_ids, n) -> transformers' greedy tokens (float32, CPU)."""
    from transformers import AutoModelForCausalLM

    models: dict[str, object] = {}

    def run(path: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        if path not in models:
            models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = models[path].generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=max_new_tokens, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt_ids):].tolist()

    return run
