"""The `omniinfer` command: `--version` stays light, `env` reports the plugin layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omniinfer.version import PLUGIN_API_VERSION, __version__

CONSOLE_SCRIPT = Path(sys.executable).with_name("omniinfer")


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OMNIINFER_")}
    return subprocess.run(args, env={**clean, **env}, capture_output=True, text=True, timeout=120)


def _imported(importtime_stderr: str) -> set[str]:
    """Module names from `-X importtime` output ("import time: self | cumulative | name")."""
    return {line.rsplit("|", 1)[1].strip() for line in importtime_stderr.splitlines()
            if line.startswith("import time:") and line.count("|") == 2}


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_answers_without_importing_torch(flag):
    code = ("import sys\nfrom omniinfer.entrypoints.cli import main\n"
            f"rc = main([{flag!r}])\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
            "print('rc', rc, 'heavy', heavy)\n")
    out = _run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"omniinfer {__version__}\nrc 0 heavy []\n"


def test_console_script_version_imports_no_torch():
    assert CONSOLE_SCRIPT.exists(), f"{CONSOLE_SCRIPT} is missing: is omniinfer installed (pip -e .)?"
    out = _run([str(CONSOLE_SCRIPT), "--version"], PYTHONPROFILEIMPORTTIME="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"omniinfer {__version__}\n"
    imported = _imported(out.stderr)
    assert "omniinfer.entrypoints.cli" in imported  # the import-time log did record
    assert "torch" not in imported


@pytest.fixture(scope="module")
def env_json() -> dict:
    out = _run([sys.executable, "-m", "omniinfer.entrypoints.cli", "env", "--json"])
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_env_json_reports_the_plugin_layer(env_json):
    import torch

    r = env_json
    assert (r["omniinfer"], r["plugin_api"], r["torch"]) == (__version__, PLUGIN_API_VERSION,
                                                             torch.__version__)
    plugins = {p["name"]: p for p in r["plugins"]}
    for name in ("cpu", "cuda", "rocm", "xpu"):
        assert plugins[name]["loaded"] and plugins[name]["error"] is None
        assert plugins[name]["distribution"] == f"omniinfer-{name}"
        assert plugins[name]["platforms"] == [name]
        platform = r["platforms"][name]
        assert isinstance(platform["available"], bool) and platform["reason"]
    assert r["platforms"]["cpu"]["available"] is True
    selected = r["selected_platform"]
    assert r["platforms"][selected]["available"]
    assert all(p["priority"] <= r["platforms"][selected]["priority"]
               for p in r["platforms"].values() if p["available"])
    backend = r["selected_attention_backend"].split()[0]
    assert backend in r["attention_backends"]
    assert backend in r["platforms"][selected]["attention_backend_preferences"]
    assert isinstance(r["cpu"]["isa_flags"], list) and r["cpu"]["usable_cpus"] >= 1
    if sys.platform == "linux":
        assert r["memory"]["memtotal_bytes"] > 0 and r["memory"]["memavailable_bytes"] > 0
    assert "selection_error" not in r


def test_env_text_matches_the_json(env_json):
    out = _run([str(CONSOLE_SCRIPT), "env"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"omniinfer {__version__} (plugin API {PLUGIN_API_VERSION}), " \
                       f"Python {sys.version.split()[0]}"
    assert f"selected platform: {env_json['selected_platform']}" in lines
    assert f"selected attention backend: {env_json['selected_attention_backend']}" in lines
    for name, platform in env_json["platforms"].items():
        verdict = "available" if platform["available"] else "unavailable"
        assert any(line.split()[:2] == [name, verdict] and platform["reason"] in line
                   for line in lines), (name, lines)
    for plugin in env_json["plugins"]:
        assert any(line.split()[:4] == [plugin["name"], plugin["distribution"], plugin["version"],
                                        "loaded"] for line in lines), (plugin, lines)


def test_env_reports_a_bad_plugin_filter_instead_of_crashing(monkeypatch, capsys):
    from omniinfer.entrypoints.cli import main
    from omniinfer.platforms.registry import reset_registry

    monkeypatch.setenv("OMNIINFER_PLUGINS", "nosuch")
    reset_registry()
    try:
        assert main(["env"]) == 0
    finally:
        reset_registry()
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("plugins: not loaded: OMNIINFER_PLUGINS='nosuch' names plugin(s) "
                               "'nosuch' that are not installed; installed plugins: ")
               for line in lines), lines
    assert "selected platform: None" in lines
