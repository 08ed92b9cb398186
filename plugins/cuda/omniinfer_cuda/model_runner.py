"""The CUDA model runner: the core runner plus CUDA graphs for decode steps."""

from __future__ import annotations

from omniinfer.worker.graph_runner import GraphRunnerMixin, capture_with
from omniinfer.worker.model_runner import ModelRunner


class CudaModelRunner(GraphRunnerMixin, ModelRunner):
    _graph_pool = None

    def capture_graph(self, fn):
        import torch

        replay, out, self._graph_pool = capture_with(torch.cuda, fn, self._graph_pool)
        return replay, out
