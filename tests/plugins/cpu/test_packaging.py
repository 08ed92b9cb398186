"""A non-editable install (a wheel, as the container images use) carries the kernels built for
every ISA level of its architecture, so its first `omniinfer generate` compiles nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from omniinfer_cpu.kernels import isa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "src"  # build from a copy: a build leaves build/ and egg-info behind
    shutil.copytree(os.path.join(ROOT, "plugins", "cpu"), source,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "lib"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp), str(source)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (name,) = [f for f in os.listdir(tmp) if f.endswith(".whl")]
    return tmp / name


def test_the_wheel_carries_every_level_of_its_architecture(wheel):
    assert wheel.name.startswith("omniinfer_cpu-") and wheel.name.endswith(f"-py3-none-linux_{isa.machine_arch()}.whl")
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert {"omniinfer_cpu/kernels/csrc/omni.h", "omniinfer_cpu/kernels/csrc/gemm.c",
            "omniinfer_cpu/plugin.py"} <= set(names)
    manifest = json.loads(archive.read("omniinfer_cpu/kernels/lib/manifest.json"))
    assert set(manifest["levels"]) == {level.name for level in isa.arch_levels()}
    for file in manifest["levels"].values():
        assert f"omniinfer_cpu/kernels/lib/{file}" in names


def test_an_installed_wheel_compiles_nothing(wheel, tmp_path):
    target, cache = tmp_path / "site", tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target), "OMNIINFER_CPU_KERNEL_CACHE": str(cache),
           "CC": "/nonexistent/cc", "OMNIINFER_LOG_LEVEL": "INFO"}  # (a build would fail loudly)
    env.pop(isa.ENV_ISA, None)
    out = subprocess.run([sys.executable, "-m", "omniinfer.entrypoints.cli", "generate", "Return the",
                          "--max-tokens", "4"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()
    level, _ = isa.choose(None)
    if level is not None:
        assert f"CPU kernels: {level.name} (the best level this CPU runs), from {target}" in out.stderr
    assert "building the CPU kernels" not in out.stderr
    assert not cache.exists() or not any(cache.iterdir())
