"""A non-editable install (a wheel, as the container images use) carries the kernel source."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_cpu_plugin_wheel_ships_the_kernel_source(tmp_path):
    source = tmp_path / "src"  # build from a copy: a build leaves build/ and egg-info behind
    shutil.copytree(os.path.join(ROOT, "plugins", "cpu"), source,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(tmp_path), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    assert "omniinfer_cpu/kernels/csrc/cpu_kernels.c" in names
    assert "omniinfer_cpu/plugin.py" in names
