"""Third-party plugins, installed for real and found only through their entry points.

The fixture distributions under tests/fixtures/ are built by pip into a temporary
``--target`` directory (never into the venv). A test sees them only while that directory is
on ``sys.path`` (the `third_party` fixture, or PYTHONPATH for a subprocess); afterwards their
modules are forgotten and the process-wide registry is reset, so no other test sees them.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from omniinfer.attention.backend import AttentionMetadata, AttentionSpec
from omniinfer.attention.common import common_for
from omniinfer.attention.reference import ReferenceBackend, ReferenceImpl
from omniinfer.attention.selector import ENV_BACKEND, candidate_names, select_attention_backend
from omniinfer.platforms.hookspec import ENTRY_POINT_GROUP, hookimpl
from omniinfer.platforms.interface import Availability, Platform
from omniinfer.platforms.legacy import LegacyBuilderAdapter
from omniinfer.platforms.registry import (
    ENV_DEVICE,
    ENV_PLUGINS,
    PluginError,
    PluginRegistry,
    api_verdict,
    reset_registry,
)
from omniinfer.testing.conformance.cases import Case, assert_matches_reference, run_case
from omniinfer.version import PLUGIN_API_VERSION, __version__

# acme is a plugin API 1.0 plugin: its deprecation warning is checked once, below
pytestmark = pytest.mark.filterwarnings("ignore:plugin acme .* plugin API 1.0:DeprecationWarning")
FIXTURES = Path(__file__).parent / "fixtures"
DISTRIBUTIONS = ("acme_plugin", "broken_plugin", "future_plugin")
PACKAGES = ("omniinfer_acme", "omniinfer_broken", "omniinfer_future")
FIXTURE_PLUGINS = {"acme", "broken", "future"}
BROKEN_ERROR = ("failed to import omniinfer_broken.plugin: ImportError: libbroken_kernels.so: "
                "cannot open shared object file: No such file or directory")
FUTURE_ERROR = (f"written for plugin API 9.0, but omniinfer {__version__} speaks plugin API "
                f"{PLUGIN_API_VERSION}; install a release of omniinfer-future made for plugin API "
                f"{PLUGIN_API_VERSION.split('.')[0]}.x")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (ENV_PLUGINS, ENV_DEVICE, ENV_BACKEND):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def fixture_site(tmp_path_factory):
    """pip-installs the fixture distributions into a fresh directory (not the venv)."""
    root = tmp_path_factory.mktemp("third_party")
    sources = []
    for dist in DISTRIBUTIONS:  # build from copies: a build leaves build/ and *.egg-info behind
        shutil.copytree(FIXTURES / dist, root / "src" / dist,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        sources.append(str(root / "src" / dist))
    site = root / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--no-index", "--no-build-isolation", "--disable-pip-version-check",
                          "--target", str(site), *sources], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, f"pip could not install the fixture plugins:\n{pip.stdout}{pip.stderr}"
    yield site
    shutil.rmtree(root, ignore_errors=True)


def _forget_fixture_modules() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES:
            del sys.modules[name]
    importlib.invalidate_caches()
    reset_registry()


@pytest.fixture
def third_party(fixture_site, monkeypatch):
    """The fixture plugins are installed for the duration of one test."""
    _forget_fixture_modules()
    monkeypatch.syspath_prepend(str(fixture_site))
    yield fixture_site
    _forget_fixture_modules()


def _record(registry: PluginRegistry, name: str):
    return next(r for r in registry.records if r.name == name)


def _spec(device_type: str = "cpu", dtype: torch.dtype = torch.float32) -> AttentionSpec:
    return AttentionSpec(device_type=device_type, platform_name=device_type, dtype=dtype,
                         head_size=64, num_heads=4, num_kv_heads=2, block_size=16)


# ---- discovery -----------------------------------------------------------------------------
def test_acme_is_discovered_through_its_entry_point(third_party):
    registry = PluginRegistry()
    acme = _record(registry, "acme")
    assert (acme.is_loaded, acme.distribution, acme.version) == (True, "omniinfer-acme", "0.3.0")
    assert (acme.platform_names, acme.backend_names) == (["acme"], ["ACME_ATTN"])
    platform = registry.platforms["acme"]
    assert platform.__module__ == "omniinfer_acme.platform"
    assert (platform.plugin_name, platform.plugin_version) == ("omniinfer-acme", "0.3.0")
    assert registry.availability()["acme"] == Availability(True, "acme accelerator simulated on the CPU")
    assert registry.backends["ACME_ATTN"].__module__ == "omniinfer_acme.attention"
    assert {"cpu", "cuda", "rocm", "xpu"} <= set(registry.platforms)


def test_acme_is_selected_only_when_named(third_party, monkeypatch):
    registry = PluginRegistry()
    assert registry.select_platform().name != "acme"  # priority -10: below the CPU
    assert registry.select_platform("acme") is registry.platforms["acme"]
    monkeypatch.setenv(ENV_DEVICE, "acme")
    acme = registry.select_platform()
    assert acme is registry.platforms["acme"]
    assert select_attention_backend(acme, _spec(), registry.backends).name == "ACME_ATTN"


def test_a_platform_that_does_not_size_its_kv_cache_starts(third_party, checkpoint_dir,
                                                           hf_greedy, monkeypatch):
    """acme implements no kv_cache_memory_bytes: the engine starts on the default (the host
    rule, for a device type torch reports no memory for), says so, and generates right."""
    from omniinfer import LLM, SamplingParams
    from omniinfer.platforms.interface import host_kv_budget
    from omniinfer.worker.cache_engine import block_bytes

    lines = []
    monkeypatch.setattr("omniinfer.logger.logging.Logger.info",
                        lambda self, msg, *args, **kw: lines.append(msg % args if args else msg))
    path = checkpoint_dir("llama")
    llm = LLM(path, device="acme", max_num_seqs=4, max_model_len=256, block_size=16)
    prompt = [5, 9, 33, 71, 2]
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8)
    config = llm.llm_engine.config
    m = config.model
    expected = host_kv_budget(config) // block_bytes(m.num_layers, 16, m.num_kv_heads, m.head_size,
                                                     m.dtype)
    assert llm.llm_engine.stats()["num_total_kv_blocks"] == expected == 4 * 256 // 16
    assert any("platform acme does not size its KV cache" in line for line in lines), lines


def test_acme_backend_joins_the_cpu_platform_after_its_preferences(third_party):
    registry = PluginRegistry()
    cpu = registry.platforms["cpu"]
    from omniinfer_cpu.kernels import build

    assert candidate_names(cpu.attention_backend_preferences, registry.backends, "cpu") == [
        "IPEX_CPU", "CPU_PAGED", "TORCH_SDPA", "REFERENCE", "TRITON", "ACME_ATTN"]
    assert "ACME_ATTN" not in candidate_names(registry.platforms["cuda"].attention_backend_preferences,
                                              registry.backends, "cuda")
    expected = "CPU_PAGED" if build.load() else "TORCH_SDPA"  # TORCH_SDPA without a C compiler
    assert select_attention_backend(cpu, _spec(), registry.backends).name == expected
    # float64: the cpu platform's own preferences refuse, the plugin's backend serves it
    assert select_attention_backend(cpu, _spec(dtype=torch.float64), registry.backends).name == "ACME_ATTN"
    assert select_attention_backend(cpu, _spec(), registry.backends, "acme_attn").name == "ACME_ATTN"


def test_acme_backend_computes_like_the_reference(third_party):
    backend = PluginRegistry().backends["ACME_ATTN"]
    outputs = []
    for cls in (backend, ReferenceBackend):
        metadata = cls.get_builder_cls()(block_size=4).build(common_for([(0, 5, [1, 0])], 4))
        impl = cls.get_impl_cls()(num_heads=2, head_size=8, scale=8 ** -0.5, num_kv_heads=1)
        kv_cache = torch.zeros(cls.get_kv_cache_shape(2, 4, 1, 8))
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(5, n, generator=gen) for n in (16, 8, 8))
        outputs.append(impl.forward(q, k, v, kv_cache, metadata))
    torch.testing.assert_close(outputs[0], outputs[1])


# ---- plugin API 1.x: adapted for one minor version -------------------------------------------
def test_a_plugin_api_1_plugin_loads_with_a_deprecation_warning(third_party):
    """acme declares plugin API 1.0: it loads (its backend's builder is the core's, which speaks
    2.0 already), and the warning says what to change."""
    with pytest.warns(DeprecationWarning) as caught:
        registry = PluginRegistry()
    acme = _record(registry, "acme")
    assert acme.is_loaded and acme.is_adapted and not _record(registry, "cpu").is_adapted
    message = str(next(w.message for w in caught if "omniinfer-acme" in str(w.message)))
    assert message == acme.warning
    assert message.startswith(f"plugin acme (omniinfer-acme 0.3.0) is written for plugin API 1.0; "
                              f"omniinfer {__version__} speaks plugin API 2.0 and runs it through an "
                              "adapter, which plugin API 2.1 removes. To move to 2.0: declare "
                              'PLUGIN_API_VERSION = "2.0"')
    for change in ("build(common: CommonAttentionMetadata)", "supported_platforms",
                   "Platform.model_transform()", "Platform.supports_graph_capture"):
        assert change in message
    assert registry.backends["ACME_ATTN"].__module__ == "omniinfer_acme.attention"


def test_which_plugin_api_versions_load():
    assert [api_verdict(v) for v in ("2.0", "2.7", "1.0", "1.3", "0.9", "3.0", "x")] == [
        "native", "native", "adapted", "adapted", None, None, None]


class _V1Builder:
    """A plugin API 1.x builder, self-contained as FLASH_ATTN's was: sees one sequence at a time."""

    metadata_cls = AttentionMetadata

    def __init__(self, block_size, sliding_window=None):
        self.block_size, self.seqs = block_size, []

    def add_seq(self, *, context_len, query_len, block_table, is_prefill):
        self.seqs.append((context_len, query_len, list(block_table), is_prefill))

    def build(self):
        from omniinfer.attention.backend import common_fields

        assert [s[3] for s in self.seqs] == sorted((s[3] for s in self.seqs), reverse=True)
        return AttentionMetadata(**common_fields(common_for([s[:3] for s in self.seqs], self.block_size)))


class _V1Backend(ReferenceBackend):
    name = "V1_ATTN"

    @classmethod
    def get_builder_cls(cls):
        return _V1Builder

    @classmethod
    def get_impl_cls(cls):
        return ReferenceImpl


def test_a_plugin_api_1_builder_runs_through_the_adapter(monkeypatch):
    ep = _module_plugin(monkeypatch, "fake_v1", PLUGIN_API_VERSION="1.2",
                        omniinfer_attention_backends=hookimpl(lambda: [_V1Backend]))
    with pytest.warns(DeprecationWarning, match="fake_v1.*plugin API 1.2"):
        registry = PluginRegistry(entry_points=[ep], only="")
    backend = registry.backends["V1_ATTN"]
    assert backend is not _V1Backend and issubclass(backend.get_builder_cls(), LegacyBuilderAdapter)
    assert backend.get_builder_cls().metadata_cls is AttentionMetadata
    case = Case("mixed", ((0, 9), (13, 6), (32, 1), (5, 1)), block_size=8)
    assert_matches_reference(run_case(backend, case, "cpu", torch.float32), torch.float32)
    common = common_for([(0, 9, [7, 2]), (13, 6, [0, 5, 9]), (32, 1, [3, 4, 6, 8, 12]), (5, 1, [1])], 8)
    native = ReferenceBackend.get_builder_cls()(8).build(common)
    adapted = backend.get_builder_cls()(8).build(common)
    assert adapted.slot_mapping.tolist() == native.slot_mapping.tolist()
    assert adapted.seq_lens == native.seq_lens and adapted.num_prefills == native.num_prefills == 2


# ---- failures are reported, the rest still loads ---------------------------------------------
def test_broken_plugin_is_reported_and_skipped(third_party):
    omniinfer_log = logging.getLogger("omniinfer")
    seen: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = seen.append
    omniinfer_log.addHandler(handler)
    try:
        registry = PluginRegistry()
    finally:
        omniinfer_log.removeHandler(handler)
    broken = _record(registry, "broken")
    assert (broken.is_loaded, broken.distribution, broken.version) == (False, "omniinfer-broken", "0.0.1")
    assert broken.error == BROKEN_ERROR
    assert "Traceback" in broken.details and "omniinfer_broken/plugin.py" in broken.details
    assert "plugin broken (omniinfer-broken 0.0.1) set aside: " + BROKEN_ERROR in [
        r.getMessage() for r in seen]
    assert f"  plugin broken (omniinfer-broken 0.0.1) failed to load: {BROKEN_ERROR}" in \
        registry.report().splitlines()
    assert {r.name for r in registry.failed()} == {"broken", "future"}
    assert all(r.is_loaded for r in registry.records if r.name not in ("broken", "future"))
    assert registry.select_platform("acme").name == "acme"


def test_plugin_api_mismatch_is_refused_at_load(third_party):
    registry = PluginRegistry()
    future = _record(registry, "future")
    assert (future.is_loaded, future.error, future.details) == (False, FUTURE_ERROR, "")
    assert registry.pm.get_plugin("future") is None  # never registered: its hooks never run
    assert f"  plugin future (omniinfer-future 9.0.0) failed to load: {FUTURE_ERROR}" in \
        registry.report().splitlines()


# ---- OMNIINFER_PLUGINS ---------------------------------------------------------------------
def test_plugins_env_restricts_loading(third_party, monkeypatch):
    monkeypatch.setenv(ENV_PLUGINS, "cpu, acme")
    registry = PluginRegistry()
    assert [r.name for r in registry.records] == ["acme", "cpu"]
    assert set(registry.platforms) == {"acme", "cpu"}
    assert registry.failed() == []
    assert "omniinfer_broken" not in sys.modules
    with pytest.raises(PluginError, match=r"^device='cuda' names a platform that is not installed"):
        registry.select_platform("cuda")


def test_plugins_env_unknown_name_lists_installed_plugins(third_party, monkeypatch):
    installed = sorted({ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP)})
    assert FIXTURE_PLUGINS | {"cpu", "cuda", "rocm", "xpu"} <= set(installed)
    monkeypatch.setenv(ENV_PLUGINS, "cpu,nosuch")
    with pytest.raises(PluginError) as info:
        PluginRegistry()
    assert str(info.value) == (f"OMNIINFER_PLUGINS='cpu,nosuch' names plugin(s) 'nosuch' that are "
                               f"not installed; installed plugins: {', '.join(installed)}")


def test_omniinfer_env_shows_failed_plugins(third_party):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIINFER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(third_party), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-m", "omniinfer.entrypoints.cli", "env"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()]
    assert ["broken", "omniinfer-broken", "0.0.1", "FAILED:", *BROKEN_ERROR.split()] in lines
    assert ["future", "omniinfer-future", "9.0.0", "FAILED:", *FUTURE_ERROR.split()] in lines
    assert ["acme", "omniinfer-acme", "0.3.0", "loaded", "[acme,", "ACME_ATTN]"] in lines


def test_env_report_json_lists_failed_plugins(third_party):
    from omniinfer.entrypoints.env_report import collect

    plugins = {p["name"]: p for p in collect()["plugins"]}
    assert plugins["broken"] == {"name": "broken", "distribution": "omniinfer-broken",
                                 "version": "0.0.1", "loaded": False, "error": BROKEN_ERROR,
                                 "platforms": [], "attention_backends": [], "models": []}
    assert plugins["acme"]["loaded"] and plugins["acme"]["attention_backends"] == ["ACME_ATTN"]


# ---- hooks that misbehave (in-memory plugins, no install needed) -----------------------------
def _module_plugin(monkeypatch, name: str, **attrs) -> md.EntryPoint:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return md.EntryPoint(name=name, value=name, group=ENTRY_POINT_GROUP)


class _DuplicateCpu(Platform):
    name = "cpu"
    device_type = "cpu"

    @classmethod
    def is_available(cls) -> Availability:
        return Availability(True, "duplicate")


def _cpu_entry_point() -> md.EntryPoint:
    return next(ep for ep in md.entry_points(group=ENTRY_POINT_GROUP) if ep.name == "cpu")


def test_plugin_without_api_version_is_refused(monkeypatch):
    ep = _module_plugin(monkeypatch, "fake_noversion")
    registry = PluginRegistry(entry_points=[ep, _cpu_entry_point()], only="")
    assert _record(registry, "fake_noversion").error == (
        f"fake_noversion does not declare PLUGIN_API_VERSION (this omniinfer speaks plugin API "
        f"{PLUGIN_API_VERSION})")
    assert set(registry.platforms) == {"cpu"}


def test_a_raising_hook_sets_the_whole_plugin_aside(monkeypatch):
    def omniinfer_attention_backends():
        raise RuntimeError("kernel library missing")

    ep = _module_plugin(monkeypatch, "fake_raises", PLUGIN_API_VERSION=PLUGIN_API_VERSION,
                        omniinfer_platforms=hookimpl(lambda: [_DuplicateCpu]),
                        omniinfer_attention_backends=hookimpl(omniinfer_attention_backends))
    registry = PluginRegistry(entry_points=[ep], only="")
    record = _record(registry, "fake_raises")
    assert not record.is_loaded
    assert record.error == "hook omniinfer_attention_backends() raised RuntimeError: kernel library missing"
    assert "RuntimeError: kernel library missing" in record.details
    assert registry.platforms == {}  # its platform hook succeeded, but the plugin is set aside


def test_two_plugins_providing_one_platform_is_an_error(monkeypatch):
    ep = _module_plugin(monkeypatch, "fake_dup", PLUGIN_API_VERSION=PLUGIN_API_VERSION,
                        omniinfer_platforms=hookimpl(lambda: [_DuplicateCpu]))
    with pytest.raises(PluginError, match=r"^platform 'cpu' is provided by two plugins: "
                                          r"'omniinfer-cpu' and '\?'; uninstall one$"):
        PluginRegistry(entry_points=[_cpu_entry_point(), ep], only="")


# ---- isolation -----------------------------------------------------------------------------
def test_fixture_plugins_are_invisible_outside_the_fixture():
    """Placed last: after the tests above, nothing of the fixture plugins is left."""
    assert not FIXTURE_PLUGINS & {ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP)}
    assert not [m for m in sys.modules if m.split(".")[0] in PACKAGES]
    for dist in ("omniinfer-acme", "omniinfer-broken", "omniinfer-future"):
        with pytest.raises(md.PackageNotFoundError):
            md.distribution(dist)
    assert {r.name for r in PluginRegistry().records} == {"cpu", "cuda", "rocm", "xpu"}
