"""Shared by the benchmark scripts (the measuring code lives in `omniinfer.benchmarks.perf`)."""

from omniinfer.benchmarks.perf import (
    DEFAULT_WORKLOADS,
    SHAPES,
    build_random_checkpoint,
    machine_line,
    model_flops,
    quiet,
    unwind_on_sigterm,
)

__all__ = ["DEFAULT_WORKLOADS", "SHAPES", "build_random_checkpoint", "machine_line", "model_flops",
           "quiet", "unwind_on_sigterm"]
