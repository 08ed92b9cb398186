"""Build hook of omniinfer-cpu: a wheel carries the CPU kernels built for every ISA level of its
architecture (omniinfer_cpu/kernels/isa.py), so an installed plugin compiles nothing at first
use. An editable install (a source checkout) builds each level at its first use instead, into
the per-user cache; so does a wheel built where no C compiler is found (with a warning here).
``OMNIINFER_CPU_PREBUILD=0`` leaves the libraries out.

The metadata is in pyproject.toml; this file only adds the build step and marks the wheel as
platform-specific (its libraries are machine code, not tied to a Python version).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
KERNELS = os.path.join(HERE, "omniinfer_cpu", "kernels")
CSRC = os.path.join(KERNELS, "csrc")

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70
    from wheel.bdist_wheel import bdist_wheel


def _isa():
    """isa.py by path: this runs before (and without) the package being importable."""
    spec = importlib.util.spec_from_file_location("_omniinfer_cpu_isa", os.path.join(KERNELS, "isa.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def build_levels(out_dir: str, log=print) -> dict:
    """Every level of this machine's architecture into out_dir, and its manifest.json."""
    isa = _isa()
    levels = isa.arch_levels()
    cc = next(filter(None, (shutil.which(n) for n in filter(None, (os.environ.get("CC"), "gcc", "cc")))), None)
    if not levels or cc is None:
        why = "no C compiler found" if levels else f"no kernel level for {isa.machine_arch()}"
        log(f"omniinfer-cpu: {why}: the wheel carries no prebuilt kernels (they build at first use)")
        return {}
    os.makedirs(out_dir, exist_ok=True)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]

    def one(level):
        target = os.path.join(out_dir, f"cpu_kernels-{level.name}.so")
        warning = isa.build_library(cc, level, isa.sources(CSRC), target)
        log(f"omniinfer-cpu: built the {level.name} kernels" + (f" ({warning})" if warning else ""))
        return level.name, os.path.basename(target)

    built = dict(map(one, levels))  # (one level at a time: each compiles its files on every CPU)
    manifest = {"source_sha256": isa.source_digest(CSRC), "compiler": version, "arch": isa.machine_arch(), "levels": built}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("OMNIINFER_CPU_PREBUILD", "1") == "0":
            return
        build_levels(os.path.join(self.build_lib, "omniinfer_cpu", "kernels", "lib"), log=self.announce_info)

    def announce_info(self, message: str) -> None:
        self.announce(message, level=2)


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        _, _, plat = super().get_tag()
        return "py3", "none", plat


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithKernels, "bdist_wheel": PlatformWheel}, distclass=BinaryDistribution)
