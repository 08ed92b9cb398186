"""Each runnable backend against the reference: prefill, decode, mixed and chunked batches."""

from __future__ import annotations

import pytest

from omniinfer.testing.conformance.cases import Case, assert_matches_reference, run_case

PREFILL = ((0, 1), (0, 7), (0, 16), (0, 33))
DECODE = ((1, 1), (8, 1), (16, 1), (40, 1), (70, 1))
MIXED = ((0, 9), (13, 6), (32, 1), (5, 1), (17, 1))  # a prompt, a chunk after context, decodes
CHUNKED = ((16, 16), (24, 5), (31, 2), (48, 1))  # chunks after a cached prefix, then a decode


def test_backend_is_runnable(conformance, candidate_backend):
    """One line per candidate backend: pass, or skip with the reasons it refused here."""
    if candidate_backend in conformance.refused:
        pytest.skip(f"{candidate_backend} cannot run on {conformance.platform.name}: "
                    + " | ".join(conformance.refused[candidate_backend]))
    assert conformance.runnable[candidate_backend] is not None


def _check(conformance, name: str, case: Case) -> None:
    backend = conformance.backend(name)
    dtype = conformance.runnable[name]
    spec = conformance.spec(dtype, head_size=case.head_size, num_heads=case.num_heads,
                            num_kv_heads=case.num_kv_heads, block_size=case.block_size,
                            sliding_window=case.sliding_window)
    reasons = backend.validate(spec)
    if reasons:
        pytest.skip(f"{name} refuses this configuration: {'; '.join(reasons)}")
    assert_matches_reference(run_case(backend, case, conformance.device, dtype), dtype)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill(conformance, conformance_backend, block_size, group):
    _check(conformance, conformance_backend, Case("prefill", PREFILL, group=group, block_size=block_size))


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode(conformance, conformance_backend, block_size, group):
    _check(conformance, conformance_backend, Case("decode", DECODE, group=group, block_size=block_size))


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch(conformance, conformance_backend, block_size):
    _check(conformance, conformance_backend, Case("mixed", MIXED, block_size=block_size, seed=1))


@pytest.mark.parametrize("block_size", [8, 16])
def test_chunked_prefill_over_paged_prefix(conformance, conformance_backend, block_size):
    _check(conformance, conformance_backend, Case("chunked", CHUNKED, block_size=block_size, seed=2))


@pytest.mark.parametrize("head_size", [32, 80, 128])
def test_head_sizes(conformance, conformance_backend, head_size):
    _check(conformance, conformance_backend, Case("heads", MIXED, head_size=head_size, seed=3))


def test_single_kv_head(conformance, conformance_backend):
    _check(conformance, conformance_backend, Case("mqa", MIXED, num_kv_heads=1, group=8, seed=4))


@pytest.mark.parametrize("window", [4, 19])
def test_sliding_window(conformance, conformance_backend, window):
    _check(conformance, conformance_backend,
           Case("window", MIXED + CHUNKED, sliding_window=window, block_size=16, seed=5))


def test_scores_far_apart(conformance, conformance_backend):
    """Queries 100x larger: scores spread over hundreds, so a running-max softmax must rescale
    its sums many times along a sequence, and a backend that defers rescaling must stay exact."""
    _check(conformance, conformance_backend,
           Case("peaky", MIXED + CHUNKED, query_scale=100.0, block_size=16, seed=6))
