"""Decode steps replayed from device graphs captured at padded batch sizes (vendor-neutral).

The core runner replays them on a platform that declares ``supports_graph_capture`` (CUDA, and
ROCm, whose HIP build serves the same API), through the CUDA graph API of torch's device module
for its device type (:func:`capture_with`); no vendor runner is needed. `ModelRunner.capture_graph`
is the one primitive (tests replace it with a stand-in that re-runs the function).

How a decode-only step runs from a graph:

* At the first decode-only step (the KV caches exist by then), one graph per batch size in
  :func:`graph_batch_sizes` is captured, largest first, over static buffers: token ids,
  positions and the backend's own metadata, built by the backend's metadata builder for that
  many dummy decodes whose slots are -1 (the backend's write path skips them).
* A step with n decodes uses the smallest captured size >= n: every tensor of its metadata is
  copied into the leading corner of the static one (the block table may be narrower), the
  slots of the padding rows are set back to -1, the graph is replayed, and the first n rows of
  the hidden states go to the LM head, which runs eagerly.

Padding rows keep whatever an earlier step left in the static buffers: valid block ids and
lengths, so their reads stay in bounds; their outputs are dropped and they write nothing.
Prefill and mixed steps, pipeline or tensor parallel runs, backends without
``supports_graph_capture``, mixture-of-experts layers whose method reads the routing on the host
(the torch reference, quantised experts: `MoEMethod.capturable`), draft models and
``enforce_eager=True`` run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from omniinfer.attention.common import build_common
from omniinfer.logger import init_logger

logger = init_logger(__name__)
MAX_GRAPH_BATCH_SIZE = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs (included; capped at 512)."""
    top = min(max_num_seqs, MAX_GRAPH_BATCH_SIZE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


def capture_with(api, fn: Callable[[], torch.Tensor], pool=None):
    """Capture `fn` with a torch device module that has the CUDA graph API (``CUDAGraph``,
    ``graph``, ``Stream``, ``stream``, ``current_stream``). Returns (replay, output, pool)."""
    stream = api.Stream()
    stream.wait_stream(api.current_stream())
    with api.stream(stream):  # warm up off the main stream (compiles, allocates)
        fn()
    api.current_stream().wait_stream(stream)
    graph = api.CUDAGraph()
    with api.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out, graph.pool()


@dataclass(slots=True)
class _DecodeGraph:
    batch_size: int
    input_tokens: torch.Tensor  # [batch_size] int64, static
    input_positions: torch.Tensor  # [batch_size] int64, static
    metadata: object  # the backend's AttentionMetadata over static tensors
    hidden: torch.Tensor  # [batch_size, hidden] written by replay
    replay: Callable[[], None]


def _leading_corner(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor | None:
    if dst.dim() != src.dim() or any(s > d for s, d in zip(src.shape, dst.shape)):
        return None
    return dst[tuple(slice(0, s) for s in src.shape)]


def disabled_reason(runner) -> str | None:
    """Why a runner on a platform that captures graphs replays none (None: it does)."""
    if runner.config.device.enforce_eager:
        return "enforce_eager=True"
    if not getattr(runner.attn_backend, "supports_graph_capture", False):
        return f"attention backend {runner.attn_backend.name} does not support graph capture"
    if runner.config.parallel.world_size > 1:
        return "tensor/pipeline parallel runs are not captured yet"
    from omniinfer.models.layers.moe import FusedMoE

    host = sorted({m.moe_method.name for m in runner.model.modules()
                   if isinstance(m, FusedMoE) and not m.moe_method.capturable})
    if host:
        return f"mixture-of-experts layers run {', '.join(host)}, which reads the routing on the host"
    return None


class DecodeGraphs:
    """The decode graphs of one runner: captured at the first decode-only step, replayed after."""

    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[int, _DecodeGraph] = {}
        self.caches: list[int] | None = None  # ids of the KV caches the graphs were captured on
        self.sizes = graph_batch_sizes(runner.config.scheduler.max_num_seqs)

    def run(self, model_input, kv_caches, intermediate_tensors) -> torch.Tensor | None:
        """This step's hidden states from a graph, or None when the step runs eagerly."""
        graph = self._graph_for(model_input, kv_caches, intermediate_tensors)
        if graph is None:
            return None
        n = model_input.num_tokens
        graph.input_tokens[:n].copy_(model_input.input_tokens)
        graph.input_positions[:n].copy_(model_input.input_positions)
        static = graph.metadata
        for f in fields(static):
            value = getattr(model_input.attn_metadata, f.name)
            if isinstance(value, torch.Tensor):
                _leading_corner(getattr(static, f.name), value).copy_(value)
        static.slot_mapping[n:].fill_(-1)
        graph.replay()
        return graph.hidden[:n]

    # ---- choosing and capturing --------------------------------------------------------------
    def _graph_for(self, model_input, kv_caches, intermediate_tensors) -> _DecodeGraph | None:
        md = model_input.attn_metadata
        if (intermediate_tensors is not None or md.num_prefills
                or md.num_decode_tokens != md.num_seqs or md.num_seqs > self.sizes[-1]):
            return None
        if self.caches != [id(c) for c in kv_caches]:
            self._capture_all(kv_caches)
        size = next(s for s in self.sizes if s >= md.num_seqs)
        graph = self.graphs[size]
        if type(md) is not type(graph.metadata):
            return None
        for f in fields(md):
            value = getattr(md, f.name)
            if isinstance(value, torch.Tensor) and _leading_corner(
                    getattr(graph.metadata, f.name), value) is None:
                return None  # wider than captured (cannot happen within max_model_len)
        return graph

    def _capture_all(self, kv_caches) -> None:
        self.graphs.clear()
        for size in reversed(self.sizes):  # largest first: later ones reuse its memory
            self.graphs[size] = self._capture(size, kv_caches)
        self.caches = [id(c) for c in kv_caches]
        logger.info("captured decode graphs for batch sizes %s", self.sizes)

    def _static_metadata(self, batch_size: int):
        runner = self.runner
        max_blocks = -(-runner.config.scheduler.max_model_len // runner.block_size)
        common = build_common([1] * batch_size, [1] * batch_size, [[0] * max_blocks] * batch_size,
                              0, runner.block_size, runner.attn_builder.needs_prefill_key_slots)
        md = runner.attn_builder.build(common)
        md.slot_mapping.fill_(-1)
        return md.to(runner.device)

    def _capture(self, batch_size: int, kv_caches) -> _DecodeGraph:
        runner = self.runner
        tokens = torch.zeros(batch_size, dtype=torch.int64, device=runner.device)
        positions = torch.ones(batch_size, dtype=torch.int64, device=runner.device)
        md = self._static_metadata(batch_size)

        def forward() -> torch.Tensor:
            return runner.model(tokens, positions, kv_caches, md, None)

        replay, hidden = runner.capture_graph(forward)
        return _DecodeGraph(batch_size, tokens, positions, md, hidden, replay)


class GraphRunnerMixin:
    """Plugin API 1.x: a vendor runner mixed this in and implemented `capture_graph`. Such a runner
    still replays graphs through its own `capture_graph` (deprecated: removed in plugin API 2.1;
    declare `Platform.supports_graph_capture = True` and drop the runner)."""
