"""The KV write path: each token's key and value land at its slot, nothing else changes, and
graph-capable backends skip padding rows (slot -1)."""

from __future__ import annotations

import pytest

from omniinfer.testing.conformance.cases import Case, count_writes

CASE = Case("write", ((0, 7), (9, 4), (20, 1), (3, 1)), block_size=8)


def test_writes_exactly_the_step_tokens(conformance, conformance_backend):
    backend = conformance.backend(conformance_backend)
    changed, owned, in_place = count_writes(backend, CASE, conformance.device,
                                            conformance.runnable[conformance_backend])
    assert changed == owned, f"{changed} cache elements changed, the step owns {owned}"
    default_layout = backend.get_kv_cache_shape(1, 8, 2, 64) == (2, 1, 8, 2, 64)
    assert in_place or not default_layout


def test_padding_slots_write_nothing(conformance, conformance_backend):
    backend = conformance.backend(conformance_backend)
    if not backend.supports_graph_capture:
        pytest.skip(f"{conformance_backend} does not support graph capture (no padding rows)")
    changed, owned, _ = count_writes(backend, CASE, conformance.device,
                                     conformance.runnable[conformance_backend], padding_rows=3)
    assert changed == owned, f"{changed} cache elements changed, the real tokens own {owned}"
