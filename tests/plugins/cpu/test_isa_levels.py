"""The CPU kernels' ISA levels: which level a CPU gets, the cap, the checks that keep a library
built for instructions the CPU lacks from ever running, and what `omniinfer env` says."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from omniinfer_cpu.kernels import build, isa

ZEN3 = set(isa.BY_NAME["avx2"].needs) | {"sse4_2", "avx"}
SKYLAKE_X = ZEN3 | set(isa.BY_NAME["avx512"].needs)
ICE_LAKE = SKYLAKE_X | {"avx512vbmi", "avx512_vnni"}
COOPER_LAKE = SKYLAKE_X | {"avx512_vnni", "avx512_bf16"}  # BF16 without VBMI
ZEN4 = ICE_LAKE | {"avx512_bf16"}
ALDER_LAKE = ZEN3 | {"avx_vnni"}  # AVX-VNNI without AVX-512 (Intel client cores since 2021)
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "avx512_fp16"}
x86_only = pytest.mark.skipif(isa.machine_arch() != "x86_64", reason="the x86 levels (this is not x86-64)")


@x86_only
@pytest.mark.parametrize("flags,best", [(ZEN3, "avx2"), (SKYLAKE_X, "avx512"), (ICE_LAKE, "avx512_vbmi"),
                                        (COOPER_LAKE, "avx512"), (ZEN4, "avx512_bf16"),
                                        (ALDER_LAKE, "avx2_vnni"), (SAPPHIRE_RAPIDS, "avx512_bf16")])
def test_the_best_level_a_cpu_runs(flags, best):
    level, why = isa.choose(None, flags)
    assert level.name == best and why == "the best level this CPU runs"
    assert [lv.name for lv in isa.runnable_levels(flags)][-1] == best


@x86_only
def test_the_cap():
    assert isa.choose("avx2", ZEN4)[0].name == "avx2"
    assert isa.choose("AVX512", ZEN4)[0].name == "avx512"
    level, why = isa.choose("avx512_bf16", ZEN3)  # a cap above the CPU: the best it has
    assert level.name == "avx2" and "lacks avx512f" in why
    assert isa.choose("avx2_vnni", SAPPHIRE_RAPIDS)[0].name == "avx2_vnni"
    level, why = isa.choose("avx2_vnni", ZEN4)  # levels are not a chain: Zen 4 lacks AVX-VNNI
    assert level.name == "avx2" and "lacks avx_vnni" in why
    assert isa.choose("avx512", ALDER_LAKE)[0].name == "avx2_vnni"
    assert isa.choose("none", ZEN4) == (None, f"switched off ({isa.ENV_ISA}=none)")
    with pytest.raises(ValueError, match=r"OMNIINFER_CPU_ISA='avx3' is not an ISA level; allowed on "
                                         r"x86_64: avx2, avx2_vnni, avx512, avx512_vbmi, avx512_bf16, none"):
        isa.choose("avx3", ZEN4)
    with pytest.raises(ValueError, match="a level for aarch64 CPUs; this is x86_64"):
        isa.choose("neon", ZEN4)


@x86_only
def test_a_cpu_below_avx2_gets_no_kernels():
    level, why = isa.choose(None, {"sse4_2", "avx"})  # e.g. Sandy Bridge
    assert level is None and why.startswith("the CPU lacks avx2, fma, f16c")


_INSN = re.compile(r"^\s*[0-9a-f]+:\t((?:[0-9a-f]{2} )+)\s*\t(?:\{vex\} )?(\S+)")
_PREFIXES = {"66", "67", "f2", "f3", "2e", "3e", "26", "36", "64", "65"}


def _instructions(path):
    """(first opcode byte after legacy prefixes, mnemonic) of each instruction objdump reads."""
    text = subprocess.run(["objdump", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    for line in text.splitlines():
        m = _INSN.match(line)
        if m:
            raw = [b for b in m.group(1).split()]
            lead = next((b for b in raw if b not in _PREFIXES), "")
            yield lead, m.group(2)


@x86_only
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump to read the libraries")
@pytest.mark.parametrize("name", ["avx2", "avx2_vnni"])
def test_the_levels_below_avx512_hold_no_avx512_instruction(name):
    """On an AVX-512 host the AVX2 levels' tests pass even with a stray EVEX instruction in their
    library, which would be a SIGILL on the CPUs the levels are for: so their code is read. In
    64-bit mode a leading 0x62 is EVEX (AVX-512's encoding) and nothing else."""
    insns = list(_instructions(build.library_path(isa.BY_NAME[name])))
    assert len(insns) > 1000
    evex = sorted({mnemonic for lead, mnemonic in insns if lead == "62"})
    assert not evex, f"the {name} library holds AVX-512 instructions: {evex[:10]}"
    vnni = {mnemonic for _, mnemonic in insns if mnemonic.startswith(("vpdpbusd", "vpdpwssd"))}
    assert bool(vnni) == (name == "avx2_vnni")  # AVX-VNNI's products exactly where the level has them


def test_a_level_the_cpu_lacks_is_never_loaded():
    """load_level refuses (names the flags) instead of loading code that would be a SIGILL."""
    for level in isa.LEVELS:
        missing = isa.missing_flags(level)
        if not missing:
            continue
        with pytest.raises(build.KernelsUnavailable, match="this CPU cannot run the"):
            build.load_level(level.name)


def test_a_mislabelled_library_is_refused(tmp_path):
    """A library reports the level it was built for; loading it as another is refused."""
    runnable = isa.runnable_levels()
    if len(runnable) < 2:
        pytest.skip(f"this CPU runs {len(runnable)} level(s); the check needs two")
    low, high = runnable[0], runnable[1]
    with pytest.raises(build.KernelsUnavailable, match=f"was built for {low.name}, not {high.name}"):
        build.Kernels(build.library_path(low), high)


def test_each_level_reports_itself(isa_level):
    assert isa_level.isa().decode() == isa_level.level.name


def test_env_reports_the_level_and_the_kernel_families(isa_level):
    from omniinfer_cpu.report import kernel_report

    report = kernel_report()
    name = isa_level.level.name
    assert report["cpu_kernels"].startswith(f"{name} (capped by {isa.ENV_ISA}={name})")
    families = report["cpu_kernel_families"]
    assert set(families) == {"packed GEMM", "coded weight copies", "int8 LM head", "decoder stack",
                             "paged attention", "layer ops", "mixture of experts", "AMX quantised prefills",
                             "weight prefetch"}
    assert families["weight prefetch"]["why"].startswith(
        f"batch-1 products (quantised, float and coded weights) prefetch the weight 4 KB ahead into "
        f"{isa_level.prefetch}")
    assert isa_level.prefetch.startswith(("L1 (", "L2 ("))
    # (the fixture sets OMNIINFER_CPU_AMX=0; below avx512_bf16 the library has no tile code at all)
    amx = families["AMX quantised prefills"]
    assert not amx["active"] and amx["why"].startswith(
        "off (OMNIINFER_CPU_AMX=0)" if name == "avx512_bf16" else "this level's library has no AMX code")
    assert families["packed GEMM"]["active"] and families["decoder stack"]["active"]
    assert families["mixture of experts"]["active"] and "routed experts" in families["mixture of experts"]["why"]
    coded = name in ("avx512_vbmi", "avx512_bf16")
    assert families["coded weight copies"]["active"] == coded
    if not coded:
        assert "avx512_vbmi" in families["coded weight copies"]["why"]


def test_omniinfer_env_without_kernels(monkeypatch):
    monkeypatch.setenv(isa.ENV_ISA, "none")
    out = subprocess.run([sys.executable, "-m", "omniinfer.entrypoints.cli", "env", "--json"],
                         capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert out.returncode == 0, out.stderr
    runtime = json.loads(out.stdout)["platform_runtime"]
    assert runtime["cpu_kernels"].startswith(f"none (switched off ({isa.ENV_ISA}=none))")
    assert not any(f["active"] for f in runtime["cpu_kernel_families"].values())
    text = subprocess.run([sys.executable, "-m", "omniinfer.entrypoints.cli", "env"], capture_output=True,
                          text=True, env=dict(os.environ), timeout=120).stdout
    assert "cpu kernel families:" in text and "  packed GEMM" in text


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")
def test_compile_and_link_builds_each_file_and_names_the_one_that_fails(tmp_path):
    """isa.compile_and_link compiles the files on several processes, then links them: a library
    whose functions call across files works, and a file that does not compile is named with the
    compiler's message (and nothing is linked)."""
    import ctypes

    (tmp_path / "a.c").write_text("int twice(int x);\nint four_times(int x) { return twice(twice(x)); }\n")
    (tmp_path / "b.c").write_text("int twice(int x) { return 2 * x; }\n")
    (tmp_path / "bad.c").write_text("int broken(void) { return undeclared_name; }\n")
    files = [str(tmp_path / f) for f in ("a.c", "b.c")]
    lib = tmp_path / "lib.so"
    assert isa.compile_and_link("gcc", list(isa.BASE_CFLAGS), files, str(lib), jobs=2) is None
    assert ctypes.CDLL(str(lib)).four_times(5) == 20
    broken = tmp_path / "broken.so"
    error = isa.compile_and_link("gcc", list(isa.BASE_CFLAGS), [*files, str(tmp_path / "bad.c")], str(broken))
    assert "bad.c" in error and "undeclared_name" in error and not broken.exists()
