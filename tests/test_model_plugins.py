"""Model architectures as plugins: the `omniinfer_models` hook. The core's own models come
through it; a third-party distribution (tests/fixtures/zoo_plugin, pip-installed into a
temporary directory, found by its entry point) adds an architecture that LLM and the OpenAI
server then run, replaces one it marks `override`, and is reported where it only collides."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from test_openai_server import call, make_engine
from test_parity import check_parity, make_prompts

from omniinfer.entrypoints.env_report import collect, format_report
from omniinfer.entrypoints.openai.api_server import ServerState
from omniinfer.models.registry import ModelRegistryError, merge_models, model_class
from omniinfer.platforms.hookspec import ENTRY_POINT_GROUP, hookimpl
from omniinfer.platforms.registry import ENV_PLUGINS, PluginRegistry, reset_registry

FIXTURE = Path(__file__).parent / "fixtures" / "zoo_plugin"
CORE_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                      "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
                      "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module")
def zoo_site(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    shutil.copytree(FIXTURE, root / "src", ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                          "--no-build-isolation", "--disable-pip-version-check", "--target",
                          str(root / "site"), str(root / "src")], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    yield root / "site"
    shutil.rmtree(root, ignore_errors=True)


def _forget() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] == "omniinfer_zoo":
            del sys.modules[name]
    importlib.invalidate_caches()
    reset_registry()


@pytest.fixture
def zoo(zoo_site, monkeypatch):
    monkeypatch.delenv(ENV_PLUGINS, raising=False)
    _forget()
    monkeypatch.syspath_prepend(str(zoo_site))
    yield
    _forget()


def _with_architecture(src: str, dst: Path, architecture: str) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [architecture]
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


# ---- the core through the hook ----------------------------------------------------------------
def test_core_models_come_through_the_hook():
    registry = PluginRegistry(entry_points=[])
    assert set(registry.models) == CORE_ARCHITECTURES
    assert {e.provider for e in registry.models.values()} == {"omniinfer"}
    for name in CORE_ARCHITECTURES:  # every target imports (lazily: only now)
        assert model_class(name, "config.json").__name__.endswith("ForCausalLM")
    assert registry.model_conflicts == []


def test_unknown_architecture_lists_the_supported(checkpoint_dir, tmp_path):
    from omniinfer import LLM

    path = _with_architecture(checkpoint_dir("llama"), tmp_path / "m", "NopeForCausalLM")
    with pytest.raises(ValueError, match=r"architecture 'NopeForCausalLM' .* is not supported; "
                                         r"supported: Gemma2ForCausalLM, Gemma3ForCausalLM"):
        LLM(path, num_kv_blocks=8)


@pytest.mark.parametrize("offered,message", [
    ({"X": 3}, r"omniinfer_models\(\)\['X'\]=3; a target is 'package.module:Class'"),
    ({"X": "no_colon"}, r"\['X'\]='no_colon'; a target is 'package.module:Class'"),
    ({"X": {"class": "a:B", "override": "yes"}}, r"\['X'\]\['override'\]='yes'; allowed: True or False"),
    ({"X": {"cls": "a:B"}}, r"a dict value has the keys 'class' and \(optionally\) 'override'"),
    ({"": "a:B"}, r"returned architecture name ''; names are non-empty strings"),
    (["a:B"], r"returned list; it returns a dict"),
])
def test_bad_answers_are_refused_with_the_reason(offered, message):
    with pytest.raises(ModelRegistryError, match=message):
        merge_models({}, "acme", offered)


def _registry_with(monkeypatch, **plugins) -> PluginRegistry:
    """A registry over in-process plugin modules (name -> omniinfer_models answer)."""
    eps = []
    for name, answer in plugins.items():
        module = types.ModuleType(f"inproc_{name}")
        module.PLUGIN_API_VERSION = "2.0"
        module.omniinfer_models = hookimpl(lambda answer=answer: answer)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        eps.append(md.EntryPoint(name=name, value=module.__name__, group=ENTRY_POINT_GROUP))
    return PluginRegistry(entry_points=eps)


def test_two_providers_are_reported_and_override_is_explicit(monkeypatch):
    registry = _registry_with(monkeypatch, a={"NewLM": "pkg_a:NewLM", "LlamaForCausalLM": "pkg_a:L"},
                              b={"NewLM": "pkg_b:NewLM",
                                 "Qwen3ForCausalLM": {"class": "pkg_b:Q", "override": True}})
    assert registry.models["NewLM"].target == "pkg_a:NewLM"  # first provider kept
    assert registry.models["NewLM"].ignored == ["?"]  # (no distribution behind an in-process plugin)
    assert registry.models["LlamaForCausalLM"].provider == "omniinfer"
    assert registry.models["Qwen3ForCausalLM"].target == "pkg_b:Q"
    assert registry.models["Qwen3ForCausalLM"].overrides == ["omniinfer"]
    assert len(registry.model_conflicts) == 2
    assert "architecture 'LlamaForCausalLM' is provided by 'omniinfer' and '?'" in registry.model_conflicts[0]


def test_a_bad_models_hook_sets_only_that_plugin_aside(monkeypatch):
    registry = _registry_with(monkeypatch, bad={"X": 1}, good={"GoodLM": "pkg:GoodLM"})
    bad = next(r for r in registry.records if r.name == "bad")
    assert not bad.is_loaded and "hook omniinfer_models()" in bad.error and "'package.module:Class'" in bad.error
    assert "X" not in registry.models and registry.models["GoodLM"].target == "pkg:GoodLM"


# ---- a third-party distribution ----------------------------------------------------------------
def test_env_lists_architectures_and_providers(zoo):
    report = collect()
    zoo_entry = dict(report["models"]["ZooLlamaForCausalLM"])
    assert zoo_entry.pop("decoder_stack").startswith("yes")  # (a LlamaForCausalLM subclass)
    assert zoo_entry == {
        "class": "omniinfer_zoo.model:ZooLlamaForCausalLM", "provider": "omniinfer-zoo",
        "overrides": [], "ignored": []}
    assert report["models"]["Gemma2ForCausalLM"]["decoder_stack"].startswith("no: its layers (Gemma2DecoderLayer)")
    assert report["models"]["MixtralForCausalLM"]["decoder_stack"].startswith("yes")  # (its "experts" part)
    assert report["models"]["Qwen2MoeForCausalLM"]["decoder_stack"].startswith("no: its sparse layers' shared expert")
    assert report["models"]["MistralForCausalLM"]["overrides"] == ["omniinfer"]
    assert report["models"]["Qwen2ForCausalLM"]["provider"] == "omniinfer"
    assert report["models"]["Qwen2ForCausalLM"]["ignored"] == ["omniinfer-zoo"]
    zoo_record = next(p for p in report["plugins"] if p["name"] == "zoo")
    assert zoo_record["models"] == ["MistralForCausalLM", "Qwen2ForCausalLM", "ZooLlamaForCausalLM"]
    text = format_report(report)
    assert "  ZooLlamaForCausalLM          omniinfer-zoo  omniinfer_zoo.model:ZooLlamaForCausalLM" in text
    assert "MistralForCausalLM           omniinfer-zoo  omniinfer_zoo.model:ZooMistralForCausalLM; " \
           "overrides omniinfer" in text
    assert ("conflict: architecture 'Qwen2ForCausalLM' is provided by 'omniinfer' and 'omniinfer-zoo'; "
            "using 'omniinfer'") in text


def test_plugin_architecture_generates_like_transformers(zoo, checkpoint_dir, hf_greedy, tmp_path):
    path = _with_architecture(checkpoint_dir("llama"), tmp_path / "zoo", "ZooLlamaForCausalLM")
    from omniinfer_zoo.model import ZooLlamaForCausalLM

    before = ZooLlamaForCausalLM.num_forwards
    check_parity(path, hf_greedy, make_prompts(300, [1, 9, 17]), num_kv_blocks=64)
    assert ZooLlamaForCausalLM.num_forwards > before  # the plugin's class ran them


def test_override_replaces_the_core_model(zoo, checkpoint_dir, hf_greedy):
    from omniinfer_zoo.model import ZooMistralForCausalLM

    before = ZooMistralForCausalLM.num_forwards
    check_parity(checkpoint_dir("mistral"), hf_greedy, make_prompts(300, [7]), num_kv_blocks=32)
    assert ZooMistralForCausalLM.num_forwards > before


def test_plugin_architecture_is_served(zoo, checkpoint_dir, hf_greedy, tmp_path):
    """The OpenAI server (official client over ASGI) serves the plugin's architecture."""
    path = _with_architecture(checkpoint_dir("llama"), tmp_path / "zoo", "ZooLlamaForCausalLM")
    prompt = make_prompts(300, [12])[0]
    from omniinfer_zoo.model import ZooLlamaForCausalLM

    before = ZooLlamaForCausalLM.num_forwards
    state = ServerState("zoo", stats_interval_s=0)
    state.attach(make_engine(path))
    try:
        async def run(client, http):
            return await client.completions.create(model="zoo", prompt=prompt, max_tokens=10,
                                                   temperature=0, extra_body={"ignore_eos": True})
        text = call(state, run).choices[0].text
    finally:
        state.shutdown()
    expected = hf_greedy(path, prompt, 10)
    assert text == state.ctx.tokenizer.decode(expected)
    assert ZooLlamaForCausalLM.num_forwards > before
