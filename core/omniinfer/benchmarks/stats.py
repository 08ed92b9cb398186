"""Percentile summaries and the tables `omniinfer bench` prints."""

from __future__ import annotations

import numpy as np

PERCENTILES = (50, 90, 99)


def summarize(values: list[float]) -> dict:
    """{"mean", "p50", "p90", "p99", "max", "count"} of `values` (NaN-free; empty -> zeros)."""
    if not values:
        return {"count": 0, "mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}, "max": 0.0}
    arr = np.asarray(values, dtype=np.float64)
    out = {"count": int(arr.size), "mean": float(arr.mean())}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    out["max"] = float(arr.max())
    return out


def latency_table(rows: dict[str, dict], unit: str = "ms") -> str:
    """A small table: one row per metric name, columns mean and the percentiles."""
    scale = {"ms": 1e3, "s": 1.0}[unit]
    head = f"  {'latency (' + unit + ')':<18}" + "".join(
        f"{c:>10}" for c in ("mean", *[f"p{p}" for p in PERCENTILES], "max"))
    lines = [head]
    for name, s in rows.items():
        cells = [s["mean"], *[s[f"p{p}"] for p in PERCENTILES], s["max"]]
        lines.append(f"  {name:<18}" + "".join(f"{v * scale:>10.2f}" for v in cells))
    return "\n".join(lines)
