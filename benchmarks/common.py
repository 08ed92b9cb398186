"""Shared by the benchmark scripts (the measuring code lives in `omniinfer.benchmarks.perf`)."""

from omniinfer.benchmarks.perf import SHAPES, build_random_checkpoint, model_flops, quiet

__all__ = ["SHAPES", "build_random_checkpoint", "model_flops", "quiet"]
