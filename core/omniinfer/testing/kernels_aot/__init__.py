"""The ahead-of-time kernel check: every catalogued Triton launch compiled for real GPU targets.

``python -m omniinfer.testing.kernels_aot`` compiles each configuration of
:func:`omniinfer.kernels.triton.catalogue.catalogue` for each of its ``TARGETS`` (sm_80, sm_90,
sm_100, gfx90a, gfx942) on any machine, GPU or not, and reports registers, spills, shared
memory against the target's limit and compile time. A configuration that does not compile,
spills or overflows shared memory fails the check unless the refusal table
(:mod:`omniinfer.kernels.triton.refusals`) lists it, in which case the backends refuse it at
run time with that reason; an entry that matches no failure fails the check too.

Run it in a process that has not imported the kernels under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from omniinfer.kernels.triton.catalogue import KernelLaunch, Target
from omniinfer.kernels.triton.refusals import KnownFailure
from omniinfer.testing.kernels_aot.compile import Compiled


@dataclass
class Result:
    """One recorded kernel launch of one catalogued configuration, compiled for one target."""

    launch: KernelLaunch
    kernel: str  # the @triton.jit function's name
    target: Target
    compiled: Compiled
    problems: list[str] = field(default_factory=list)  # what makes it unusable on the target
    refused_by: KnownFailure | None = None  # the table entry that covers the problems


@dataclass
class Report:
    results: list[Result]  # in catalogue order, then target order
    targets: list[Target]  # the ones compiled for
    skipped_targets: dict[str, str]  # name -> why (an optional target this triton lacks)
    table: tuple[KnownFailure, ...] = ()  # the refusal table it was judged against
    failures: list[str] = field(default_factory=list)  # empty: the check passed
    complete: bool = False  # the whole catalogue for every target
    wall_seconds: float = 0.0
    jobs: int = 1
    triton_version: str = ""


def problems(compiled: Compiled, target: Target) -> list[str]:
    """What keeps this compiled kernel from running (well) on `target`."""
    if compiled.error:
        return [f"does not compile: {compiled.error}"]
    found = []
    if compiled.spill_bytes:
        found.append(f"spills {compiled.spill_bytes} bytes to local memory")
    if compiled.shared_bytes is not None and compiled.shared_bytes > target.max_shared_bytes:
        found.append(f"needs {compiled.shared_bytes} bytes of shared memory, {target.name} "
                     f"allows {target.max_shared_bytes}")
    if compiled.registers is None:
        found.append("no register count in the compiler's report")
    return found


def assess(results: list[Result], table: tuple[KnownFailure, ...], complete: bool = True
           ) -> list[str]:
    """Fill each result's problems and refusal; return the check's failures (empty: passed).

    `complete`: the whole catalogue was compiled, so a table entry that matches no catalogued
    configuration is stale too (with a filtered run only entries matching what ran are judged).
    """
    failures = []
    for r in results:
        r.problems = problems(r.compiled, r.target)
        if r.problems:
            r.refused_by = next((e for e in table if _covers(e, r)), None)
            if r.refused_by is None:
                failures.append(
                    f"{r.launch.name} [{r.kernel}] on {r.target.name}: {'; '.join(r.problems)} "
                    "(fix the kernel or its launch, or list it in "
                    "omniinfer/kernels/triton/refusals.py so that backends refuse it)")
    for entry in table:
        matched = [r for r in results if _covers(entry, r)]
        if any(r.problems for r in matched):
            continue
        if matched:
            failures.append(f"refusals.py: {entry.op} on {', '.join(entry.targets)} "
                            f"({entry.reason}) no longer fails for {matched[0].launch.config}: "
                            "remove or narrow the entry")
        elif complete:
            failures.append(f"refusals.py: {entry.op} on {', '.join(entry.targets)} "
                            f"({entry.reason}) matches no catalogued configuration")
    return failures


def _covers(entry: KnownFailure, r: Result) -> bool:
    from omniinfer.kernels.triton.catalogue import target_for_arch

    target = target_for_arch(r.target.name)  # the device present runs its family's code
    return (entry.op == r.launch.op and target is not None and target.name in entry.targets
            and entry.applies(r.launch.shape))


# ---- running it --------------------------------------------------------------------------------
def load_launches(extra: list[str] = ()) -> tuple[list[KernelLaunch], tuple[KnownFailure, ...]]:
    """The core catalogue and refusal table, plus those of `extra` sources ("module:function" or
    "path/to/file.py:function"; such a module may define its own KNOWN_FAILURES)."""
    from omniinfer.kernels.triton.catalogue import catalogue
    from omniinfer.kernels.triton.refusals import KNOWN_FAILURES

    launches, table = catalogue(), KNOWN_FAILURES
    for spec in extra:
        module = _import(spec.rpartition(":")[0] or spec)
        launches = launches + list(getattr(module, spec.rpartition(":")[2] or "catalogue")())
        table = table + tuple(getattr(module, "KNOWN_FAILURES", ()))
    return launches, table


def _import(name: str):
    import importlib
    import importlib.util
    import os
    import sys

    if not name.endswith(".py"):
        return importlib.import_module(name)
    module_name = "aot_catalogue_" + os.path.basename(name).removesuffix(".py")
    spec = importlib.util.spec_from_file_location(module_name, name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def run_check(extra: list[str] = (), *, ops: list[str] = (), targets: list[str] = (),
              jobs: int = 1, device: bool = False) -> Report:
    """Compile the catalogue (only `ops` / `targets` when given) in a fresh triton cache, on
    `jobs` processes, and assess it; with `device`, also for the GPU present, loaded."""
    import os
    import tempfile
    import time

    import triton

    from omniinfer.kernels.triton.catalogue import TARGETS

    if triton.knobs.runtime.interpret:
        raise RuntimeError("TRITON_INTERPRET is set: the kernels would be interpreted, not "
                           "compiled; run the check in a process without it")
    if unknown := set(targets) - {t.name for t in TARGETS}:
        raise ValueError(f"unknown targets {sorted(unknown)}; known: {[t.name for t in TARGETS]}")
    start = time.perf_counter()
    previous = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="omniinfer-aot-") as cache:
        # workers inherit the variable; a fresh cache makes compile times real (no cache hits)
        os.environ["TRITON_CACHE_DIR"] = triton.knobs.cache.dir = cache
        try:
            report = _run(list(extra), ops, [t for t in TARGETS if not targets or t.name in targets],
                          jobs, device)
        finally:
            del triton.knobs.cache.dir
            if previous is None:
                os.environ.pop("TRITON_CACHE_DIR")
            else:
                os.environ["TRITON_CACHE_DIR"] = previous
    report.wall_seconds = time.perf_counter() - start
    report.complete = not ops and not targets and not report.skipped_targets
    report.failures = assess(report.results, report.table, complete=report.complete)
    return report


def _run(extra: list[str], ops: list[str], wanted: list[Target], jobs: int,
         device: bool) -> Report:
    import triton

    from omniinfer.testing.kernels_aot import compile as aot

    launches, table = load_launches(extra)
    chosen = [i for i, launch in enumerate(launches) if not ops or launch.op in ops]
    # (launch, recorded kernel call): a launch may make several kernel calls
    calls = [(i, j) for i in chosen for j in range(len(aot.record(launches[i])))]
    with _mapper(jobs, extra) as map_:
        optional = [t for t in wanted if t.optional]
        skipped = {t.name: why for t, why in zip(optional, map_(aot.probe_task, optional)) if why}
        wanted = [t for t in wanted if t.name not in skipped]
        tasks = [(i, j, t) for i, j in calls for t in wanted]
        done = dict(zip(tasks, map_(aot.compile_task, tasks)))
    if device:  # in this process, which owns the GPU context
        aot.init_worker(extra)
        gpu = aot.device_target()
        done.update({(i, j, gpu): aot.compile_task((i, j, gpu)) for i, j in calls})
        wanted.append(gpu)
    results = []
    for i, j in calls:
        for t in wanted:
            kernel, compiled = done[(i, j, t)]
            results.append(Result(launches[i], kernel, t, compiled))
    return Report(results, wanted, skipped, table=table, jobs=jobs,
                  triton_version=triton.__version__)


@contextlib.contextmanager
def _mapper(jobs: int, extra: list[str]):
    """map() over `jobs` spawned compiler processes (or this one)."""
    from omniinfer.testing.kernels_aot import compile as aot

    if jobs <= 1:
        aot.init_worker(extra)
        yield lambda fn, items: [fn(item) for item in items]
        return
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(
            jobs, mp_context=multiprocessing.get_context("spawn"), initializer=aot.init_worker,
            initargs=(extra,)) as pool:
        yield lambda fn, items: list(pool.map(fn, items, chunksize=1))
