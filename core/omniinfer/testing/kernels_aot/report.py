"""The check's report: one table (configurations x targets) and a JSON form of the same numbers."""

from __future__ import annotations

import json
from itertools import groupby

from omniinfer.kernels.triton.catalogue import Target
from omniinfer.testing.kernels_aot import Report, Result


def _cell(r: Result) -> str:
    c = r.compiled
    if c.error:
        text = "compile error"
    else:
        registers = "?" if c.registers is None else c.registers
        spilled = "?" if c.spill_bytes is None else c.spill_bytes
        text = f"{registers}/{spilled} {(c.shared_bytes or 0) / 1024:.1f}K {c.seconds:.1f}s"
    if r.problems:
        text = ("REFUSED " if r.refused_by else "FAIL ") + text
    return text


def table(report: Report) -> str:
    """The report as printed: per op, one row per configuration and one cell per target
    (registers/spilled bytes, shared memory, compile seconds), then each target's extremes."""
    targets, results = report.targets, report.results
    num_configs = len({(r.launch.op, r.launch.config, r.kernel) for r in results})
    width = max([len(r.launch.config) + 4 for r in results] + [32])
    cell = max([len(_cell(r)) for r in results] + [16]) + 2

    def row(label: str, cells: list[str]) -> str:
        return f"{label:<{width}}" + "".join(f"{c:>{cell - 2}}  " for c in cells)

    lines = [f"Triton kernels compiled ahead of time (triton {report.triton_version}): "
             f"{num_configs} configurations x {len(targets)} targets = {len(results)} compiles "
             f"in {report.wall_seconds:.1f} s wall on {report.jobs} process(es)",
             "cell: registers/spilled bytes, shared memory, compile seconds "
             "(GPU: the device present, loaded by its driver)",
             row("op / configuration", [f"{t.name}{' GPU' if t.is_device else ''} "
                                        f"<={t.max_shared_bytes // 1024}K" for t in targets])]
    for op, op_rows in groupby(results, key=lambda r: r.launch.op):
        lines.append(op)
        for (config, _), cells in groupby(op_rows, key=lambda r: (r.launch.config, r.kernel)):
            by_target = {r.target: r for r in cells}
            lines.append(row(f"  {config}", [_cell(by_target[t]) if t in by_target else "-"
                                             for t in targets]))
    lines.append(row("most registers (of max)", [f"{_most(results, t, 'registers')}/"
                                                 f"{t.max_registers}" for t in targets]))
    lines.append(row("most shared memory (of limit)", [_share(results, t) for t in targets]))
    lines.append(row("compile seconds (sum)", [
        f"{sum(r.compiled.seconds for r in results if r.target is t):.1f}" for t in targets]))
    for name, why in report.skipped_targets.items():
        lines.append(f"{name}: not compiled, the installed triton cannot target it ({why})")
    lines += [f"refused: {r.launch.name} on {r.target.name}: {r.refused_by.reason}"
              for r in results if r.refused_by]
    lines += [f"FAILED: {f}" for f in report.failures]
    lines.append("result: " + (f"FAIL ({len(report.failures)} failure(s))" if report.failures
                               else "PASS"))
    return "\n".join(lines)


def _most(results: list[Result], target: Target, field: str) -> str:
    values = [getattr(r.compiled, field) for r in results
              if r.target is target and getattr(r.compiled, field) is not None]
    return str(max(values)) if values else "-"


def _share(results: list[Result], target: Target) -> str:
    used = [r.compiled.shared_bytes for r in results
            if r.target is target and r.compiled.shared_bytes is not None]
    if not used:
        return "-"
    return f"{max(used) / 1024:.1f}K {100 * max(used) / target.max_shared_bytes:.0f}%"


def to_json(report: Report) -> str:
    return json.dumps(dict(
        triton_version=report.triton_version, wall_seconds=round(report.wall_seconds, 2),
        jobs=report.jobs, complete=report.complete, failures=report.failures,
        skipped_targets=report.skipped_targets,
        targets=[dict(name=t.name, platform=t.platform, max_shared_bytes=t.max_shared_bytes,
                      max_registers=t.max_registers, is_device=t.is_device)
                 for t in report.targets],
        results=[dict(op=r.launch.op, config=r.launch.config, kernel=r.kernel,
                      target=r.target.name, is_device=r.target.is_device,
                      registers=r.compiled.registers, spill_bytes=r.compiled.spill_bytes,
                      shared_bytes=r.compiled.shared_bytes, seconds=round(r.compiled.seconds, 3),
                      error=r.compiled.error, problems=r.problems,
                      refused=r.refused_by.reason if r.refused_by else None,
                      details=r.compiled.details) for r in report.results],
    ), indent=1)
