"""The ISA levels the CPU kernels are built for, and which of them a CPU can run.

One library per level, as ggml's CPU variants and oneDNN's dispatch do: the wheel carries every
level of its architecture, and the best level the CPU has is loaded (a cap,
``OMNIINFER_CPU_ISA``, lowers it). Running code built for an instruction the CPU lacks is a
SIGILL, so a level is only ever loaded when every flag it needs is in the CPU's own list.

Standard library only: ``setup.py`` imports this file by path to build the libraries into a
wheel, where neither torch nor omniinfer is importable.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

ENV_ISA = "OMNIINFER_CPU_ISA"  # a cap: the best level at or below it that the CPU runs
OFF = ("none", "off", "0")  # ... or no compiled kernels at all


@dataclass(frozen=True, slots=True)
class IsaLevel:
    name: str
    arch: str  # platform.machine() family: "x86_64" or "aarch64"
    needs: tuple[str, ...]  # flag names as /proc/cpuinfo spells them
    cflags: tuple[str, ...]  # what gcc is told
    summary: str


_V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm")
_V4 = _V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")

# Each arch's levels, lowest first; a level's library runs on every CPU that has its flags. Not a
# chain: a CPU may run a level and not the one before it (Zen 4 and Ice Lake have AVX-512 VNNI but
# not AVX-VNNI); the best runnable level at or below a cap is taken.
LEVELS: tuple[IsaLevel, ...] = (
    IsaLevel("avx2", "x86_64", _V3, ("-march=x86-64-v3",),
             "x86-64-v3: AVX2, FMA, F16C (Haswell and later, Zen 1-3)"),
    IsaLevel("avx2_vnni", "x86_64", _V3 + ("avx_vnni",), ("-march=x86-64-v3", "-mavxvnni"),
             "x86-64-v3 + AVX-VNNI (Intel cores since Alder Lake, Zen 5): vpdpbusd int8 products"),
    IsaLevel("avx512", "x86_64", _V4, ("-march=x86-64-v4",),
             "x86-64-v4: AVX-512 F/BW/CD/DQ/VL (Skylake-SP and later)"),
    IsaLevel("avx512_vbmi", "x86_64", _V4 + ("avx512vbmi", "avx512_vnni"),
             ("-march=x86-64-v4", "-mavx512vbmi", "-mavx512vnni"),
             "x86-64-v4 + VBMI, VNNI (Ice Lake and later): the coded weight copies"),
    IsaLevel("avx512_bf16", "x86_64", _V4 + ("avx512vbmi", "avx512_vnni", "avx512_bf16"),
             ("-march=x86-64-v4", "-mavx512vbmi", "-mavx512vnni", "-mavx512bf16"),
             "x86-64-v4 + VBMI, VNNI, BF16 (Zen 4, Sapphire Rapids): vdpbf16ps products"),
    IsaLevel("neon", "aarch64", ("asimd",), ("-march=armv8-a",),
             "Armv8-A with Advanced SIMD (every aarch64 CPU)"),
)
BY_NAME = {level.name: level for level in LEVELS}


def machine_arch(machine: str | None = None) -> str:
    m = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(m, m)


def arch_levels(arch: str | None = None) -> list[IsaLevel]:
    arch = arch or machine_arch()
    return [level for level in LEVELS if level.arch == arch]


def cpu_flags() -> set[str]:
    """The CPU's feature flags as the kernel reports them (x86 `flags`, Arm `Features`)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    if machine_arch() == "aarch64":  # every aarch64 CPU has Advanced SIMD (macOS has no cpuinfo)
        return {"asimd"}
    return set()


def missing_flags(level: IsaLevel, flags: set[str] | None = None) -> list[str]:
    """The flags `level` needs that this CPU lacks ([] when it can run it)."""
    if level.arch != machine_arch():
        return [f"an {level.arch} CPU (this is {machine_arch()})"]
    have = cpu_flags() if flags is None else flags
    return [f for f in level.needs if f not in have]


def runnable_levels(flags: set[str] | None = None) -> list[IsaLevel]:
    """The levels this CPU runs, lowest first."""
    have = cpu_flags() if flags is None else flags
    return [level for level in arch_levels() if not missing_flags(level, have)]


def choose(cap: str | None, flags: set[str] | None = None) -> tuple[IsaLevel | None, str]:
    """The level to load under `cap` (None or "" for none), and a sentence saying why.

    Raises ValueError for a cap that names no level."""
    runnable = runnable_levels(flags)
    cap = (cap or "").strip().lower()
    if cap in OFF:
        return None, f"switched off ({ENV_ISA}={cap})"
    if cap and cap not in BY_NAME:
        allowed = ", ".join([level.name for level in arch_levels()] + ["none"])
        raise ValueError(f"{ENV_ISA}={cap!r} is not an ISA level; allowed on {machine_arch()}: {allowed}")
    if cap and BY_NAME[cap].arch != machine_arch():
        allowed = ", ".join(level.name for level in arch_levels()) or "none"
        raise ValueError(f"{ENV_ISA}={cap!r} is a level for {BY_NAME[cap].arch} CPUs; this is "
                         f"{machine_arch()} (levels: {allowed})")
    if not runnable:
        lowest = arch_levels()
        if not lowest:
            return None, f"no kernel level is built for {machine_arch()} CPUs"
        return None, (f"the CPU lacks {', '.join(missing_flags(lowest[0], flags))}, which the lowest "
                      f"level ({lowest[0].name}) needs")
    if not cap:
        return runnable[-1], "the best level this CPU runs"
    order = [level.name for level in arch_levels()]
    below = [level for level in runnable if order.index(level.name) <= order.index(cap)]
    if not below:
        return None, f"{ENV_ISA}={cap}: this CPU runs no level at or below it"
    best = below[-1]
    if best.name == cap:
        return best, f"capped by {ENV_ISA}={cap}"
    return best, (f"{ENV_ISA}={cap}, but the CPU lacks {', '.join(missing_flags(BY_NAME[cap], flags))}; "
                  f"the best level below it")


# ---- building one level's library (here, or by setup.py into a wheel) ------------------------
COMPILE_CFLAGS = ("-O3", "-fPIC", "-std=gnu11")
BASE_CFLAGS = COMPILE_CFLAGS + ("-shared",)


def sources(csrc: str) -> list[str]:
    """The kernel families' C files in `csrc`, all built into one library."""
    import os

    return sorted(os.path.join(csrc, f) for f in os.listdir(csrc) if f.endswith(".c"))


def source_digest(csrc: str) -> str:
    """sha256 over every C file and header in `csrc`: what a built library was built from."""
    import hashlib
    import os

    key = hashlib.sha256()
    for name in sorted(f for f in os.listdir(csrc) if f.endswith((".c", ".h"))):
        with open(os.path.join(csrc, name), "rb") as f:
            key.update(name.encode() + b"\0" + f.read() + b"\0")
    return key.hexdigest()


def build_jobs() -> int:
    """Compiler processes at once: the CPUs this process may use."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # (no affinity outside Linux)
        return os.cpu_count() or 1


def compile_and_link(cc: str, cflags: list[str] | tuple[str, ...], files: list[str], out: str,
                     link: list[str] | tuple[str, ...] = ("-lm",), jobs: int | None = None) -> str | None:
    """Compile each of `files` with `cflags`, `jobs` at once, and link the objects into `out`
    (`cflags` are given to the link too: -shared, -fopenmp, -march). One gcc call over all the
    files compiles them one after another; the kernels' ~20 files take 22 s on one core, 11 s
    on two. None when built, else the compiler's messages (the first failing file's)."""
    import concurrent.futures
    import os
    import subprocess
    import tempfile

    compile_flags = [f for f in cflags if f != "-shared"]
    with tempfile.TemporaryDirectory(prefix="omni-build-") as tmp:
        objects = [os.path.join(tmp, f"{i}-{os.path.basename(f)}.o") for i, f in enumerate(files)]

        def one(pair):
            return subprocess.run([cc, *compile_flags, "-c", pair[0], "-o", pair[1]], capture_output=True, text=True)

        with concurrent.futures.ThreadPoolExecutor(max(1, min(len(files), jobs or build_jobs()))) as pool:
            failed = [r for r in pool.map(one, zip(files, objects)) if r.returncode != 0]
        if not failed:
            linked = subprocess.run([cc, *cflags, *objects, "-o", out, *link], capture_output=True, text=True)
            failed = [linked] if linked.returncode != 0 else []
    if not failed:
        return None
    return failed[0].stderr.strip() or f"exit status {failed[0].returncode}"


def build_library(cc: str, level: IsaLevel, files: list[str], target: str, jobs: int | None = None) -> str | None:
    """Compile `files` for `level` into one library at `target` (atomically: concurrent builders
    race harmlessly), `jobs` compiler processes at once. Returns None, or a warning when it had to
    go without OpenMP. Raises RuntimeError with the compiler's last line when it cannot build."""
    import os
    import tempfile

    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    errors = []
    # with OpenMP first; a compiler without libgomp still gets single-threaded kernels
    for extra in (["-fopenmp"], []):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(target) or ".")
        os.close(fd)
        error = compile_and_link(cc, [*BASE_CFLAGS, *level.cflags, *extra], files, tmp, jobs=jobs)
        if error is None:
            os.replace(tmp, target)
            return None if extra else f"built without OpenMP (single-threaded): {errors[-1]}"
        os.unlink(tmp)
        errors.append(error.splitlines()[-1])
    raise RuntimeError(f"{os.path.basename(cc)} failed to build the CPU kernels for {level.name}: "
                       f"{errors[0]}")
