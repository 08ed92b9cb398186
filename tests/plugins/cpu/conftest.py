"""Fixtures for the CPU plugin's tests: the kernels at every ISA level this CPU runs."""

from __future__ import annotations

import pytest

from omniinfer_cpu.kernels import build, isa


def level_params(levels=None):
    """Each of the arch's levels (or `levels`) as a param, skipped with the flags this CPU lacks
    where it cannot run it (running it would be a SIGILL)."""
    out = []
    for level in isa.arch_levels():
        if levels is not None and level.name not in levels:
            continue
        missing = isa.missing_flags(level)
        out.append(pytest.param(level.name, id=level.name, marks=pytest.mark.skipif(
            bool(missing), reason=f"this CPU lacks {', '.join(missing)}, which the {level.name} kernels need")))
    return out


@pytest.fixture(params=level_params())
def isa_level(request, monkeypatch):
    """The kernels of one ISA level, and the engine capped to it (OMNIINFER_CPU_ISA); AMX's tiles
    off (OMNIINFER_CPU_AMX=0: the level's own products; test_quant_amx.py turns them on)."""
    monkeypatch.setenv(isa.ENV_ISA, request.param)
    monkeypatch.setenv(build.ENV_AMX, "0")
    build.reset()
    kernels = build.load()
    if kernels is None:
        pytest.skip(f"CPU kernels unavailable: {build.unavailable_reason()}")
    assert kernels.level.name == request.param
    yield kernels
    monkeypatch.undo()
    build.reset()
