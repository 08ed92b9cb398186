"""Decode steps replayed from device graphs captured at padded batch sizes (vendor-neutral).

A vendor's model runner mixes :class:`GraphRunnerMixin` in before the core ``ModelRunner`` and
implements one primitive, :meth:`GraphRunnerMixin.capture_graph`; for devices whose torch
module has the CUDA graph API (``torch.cuda`` on NVIDIA and on ROCm's HIP build) that is one
call to :func:`capture_with`.

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
``supports_graph_capture`` and ``enforce_eager=True`` run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

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


class GraphRunnerMixin:
    """Mix in before ``ModelRunner``; implement :meth:`capture_graph`."""

    def capture_graph(self, fn: Callable[[], torch.Tensor]):
        """Capture `fn` (a forward pass over static buffers) in a device graph.

        Returns ``(replay, output)``: calling ``replay()`` re-runs the captured work, which
        rewrites ``output`` in place. Vendor runners implement it (``capture_with`` does it for
        the CUDA graph API)."""
        raise NotImplementedError

    def graphs_disabled_reason(self) -> str | None:
        """Why this runner replays no graphs (None: it does)."""
        if self.config.device.enforce_eager:
            return "enforce_eager=True"
        if not getattr(self.attn_backend, "supports_graph_capture", False):
            return f"attention backend {self.attn_backend.name} does not support graph capture"
        if self.config.parallel.world_size > 1:
            return "tensor/pipeline parallel runs are not captured yet"
        return None

    def load_model(self, progress: bool = True) -> None:
        super().load_model(progress)
        self._graphs: dict[int, _DecodeGraph] = {}
        self._graph_caches: list[int] | None = None
        reason = self.graphs_disabled_reason()
        self._graph_sizes = [] if reason else graph_batch_sizes(self.config.scheduler.max_num_seqs)
        if reason:
            logger.info("decode steps run eagerly: %s", reason)

    @torch.inference_mode()
    def execute_model(self, model_input, kv_caches, intermediate_tensors=None, greedy_tokens=False):
        graph = self._graph_for(model_input, kv_caches, intermediate_tensors)
        if graph is None:
            return super().execute_model(model_input, kv_caches, intermediate_tensors, greedy_tokens)
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
        return self.logits_or_tokens(graph.hidden[:n][model_input.logits_indices], greedy_tokens)

    # ---- choosing and capturing --------------------------------------------------------------
    def _graph_for(self, model_input, kv_caches, intermediate_tensors) -> _DecodeGraph | None:
        md = model_input.attn_metadata
        if (not self._graph_sizes or intermediate_tensors is not None or md.num_prefills
                or md.num_decode_tokens != md.num_seqs or md.num_seqs > self._graph_sizes[-1]):
            return None
        if self._graph_caches != [id(c) for c in kv_caches]:
            self._capture_all(kv_caches)
        size = next(s for s in self._graph_sizes if s >= md.num_seqs)
        graph = self._graphs[size]
        if type(md) is not type(graph.metadata):
            return None
        for f in fields(md):
            value = getattr(md, f.name)
            if isinstance(value, torch.Tensor) and _leading_corner(
                    getattr(graph.metadata, f.name), value) is None:
                return None  # wider than captured (cannot happen within max_model_len)
        return graph

    def _capture_all(self, kv_caches) -> None:
        self._graphs.clear()
        for size in reversed(self._graph_sizes):  # largest first: later ones reuse its memory
            self._graphs[size] = self._capture(size, kv_caches)
        self._graph_caches = [id(c) for c in kv_caches]
        logger.info("captured decode graphs for batch sizes %s", self._graph_sizes)

    def _static_metadata(self, batch_size: int):
        max_blocks = -(-self.config.scheduler.max_model_len // self.block_size)
        builder = self.attn_backend.get_builder_cls()(self.block_size, self.model_config.sliding_window)
        for _ in range(batch_size):
            builder.add_seq(context_len=1, query_len=1, block_table=[0] * max_blocks,
                            is_prefill=False)
        md = builder.build()
        md.slot_mapping.fill_(-1)
        return md.to(self.device)

    def _capture(self, batch_size: int, kv_caches) -> _DecodeGraph:
        tokens = torch.zeros(batch_size, dtype=torch.int64, device=self.device)
        positions = torch.ones(batch_size, dtype=torch.int64, device=self.device)
        md = self._static_metadata(batch_size)

        def forward() -> torch.Tensor:
            return self.model(tokens, positions, kv_caches, md, None)

        replay, hidden = self.capture_graph(forward)
        return _DecodeGraph(batch_size, tokens, positions, md, hidden, replay)
