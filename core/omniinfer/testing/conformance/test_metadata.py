"""Metadata builder invariants every backend's builder must keep: from the step's
CommonAttentionMetadata, in one `build(common)` call (plugin API 2)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from omniinfer.attention.common import slot_mapping_for
from omniinfer.testing.conformance.cases import Case, build_common_metadata, build_metadata

CASE = Case("mixed", ((0, 9), (13, 6), (0, 1), (32, 1), (5, 1)), block_size=8)
TABLES = [[7, 2], [0, 5, 9], [11], [3, 4, 6, 8, 12], [1]]


def _metadata(conformance, name):
    return build_metadata(conformance.backend(name), CASE, CASE.ordered(), TABLES)


def test_common_fields(conformance, conformance_backend):
    md = _metadata(conformance, conformance_backend)
    ctx = np.array([c for c, _ in CASE.ordered()])
    q = np.array([n for _, n in CASE.ordered()])
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (3, 16, 2)
    assert md.seq_lens == (ctx + q).tolist() and md.query_lens == q.tolist()
    assert md.seq_lens_tensor.tolist() == md.seq_lens and md.seq_lens_tensor.dtype == torch.int32
    assert md.context_lens_tensor.tolist() == ctx.tolist()
    assert md.query_start_loc.tolist() == [0, 9, 15, 16, 17, 18]
    assert (md.max_query_len, md.max_seq_len) == (9, 33)
    for i, table in enumerate(TABLES):
        assert md.block_tables[i, :len(table)].tolist() == table
    tables = md.block_tables.numpy()
    assert md.slot_mapping.tolist() == slot_mapping_for(tables, ctx, q, CASE.block_size).tolist()
    assert md.slot_mapping.dtype == torch.int64


def test_prefill_and_decode_parts(conformance, conformance_backend):
    md = _metadata(conformance, conformance_backend)
    p, d = md.prefill_metadata, md.decode_metadata
    assert (p.num_seqs, p.num_prefill_tokens, p.num_decode_tokens) == (3, 16, 0)
    assert (d.num_seqs, d.num_prefills, d.num_decode_tokens) == (2, 0, 2)
    assert p.query_start_loc.tolist() == [0, 9, 15, 16] and d.query_start_loc.tolist() == [0, 1, 2]
    assert torch.equal(torch.cat([p.slot_mapping, d.slot_mapping]), md.slot_mapping)
    assert p.seq_lens + d.seq_lens == md.seq_lens
    assert torch.equal(torch.cat([p.block_tables, d.block_tables]), md.block_tables)
    assert (p.max_query_len, d.max_query_len, d.max_seq_len) == (9, 1, 33)


def test_single_stage_batches_are_their_own_part(conformance, conformance_backend):
    backend = conformance.backend(conformance_backend)
    prompts = build_metadata(backend, CASE, [(0, 9), (13, 6)], TABLES[:2])
    decodes = build_metadata(backend, CASE, [(32, 1), (5, 1)], TABLES[3:])
    assert prompts.prefill_metadata is prompts and prompts.decode_metadata is None
    assert decodes.decode_metadata is decodes and decodes.prefill_metadata is None


def test_moves_and_round_trips(conformance, conformance_backend):
    md = _metadata(conformance, conformance_backend)
    moved = md.to(conformance.device)
    back = type(md).from_dict({k: v.cpu() if isinstance(v, torch.Tensor) else v
                               for k, v in moved.as_dict().items()})
    for f in dataclasses.fields(md):
        a, b = getattr(md, f.name), getattr(back, f.name)
        if isinstance(a, torch.Tensor):
            assert getattr(moved, f.name).device.type == conformance.device.type, f.name
            assert torch.equal(a, b), f.name
        else:
            assert a == b, f.name


def _assert_same(got, expected) -> None:
    assert type(got) is type(expected)
    for f in dataclasses.fields(expected):
        a, b = getattr(got, f.name), getattr(expected, f.name)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{f.name}: {a} != {b}"
        else:
            assert a == b, f"{f.name}: {a} != {b}"


def test_multi_step_decode_metadata(conformance, conformance_backend):
    """The common description advanced one token (`next_decode_step`: speculative drafting,
    multi-step decoding), built by the backend, gives what the builder gives for that batch
    described anew; twice in a row."""
    backend = conformance.backend(conformance_backend)
    seqs = [(0, 9), (13, 6), (32, 1), (5, 1)]
    tables = [[7, 2], [0, 5, 9], [3, 4, 6, 8, 12], [1]]
    builder = backend.get_builder_cls()(CASE.block_size)
    step = build_common_metadata(backend, CASE, seqs, tables)
    for ahead in (0, 1):
        step = step.next_decode_step()
        _assert_same(builder.build(step),
                     build_metadata(backend, CASE, [(c + q + ahead, 1) for c, q in seqs], tables))


def test_advance_built_decode_metadata(conformance, conformance_backend):
    """The same from a decode-only batch (multi-step decoding), whose advanced steps are built
    from the common description one token ahead each time."""
    backend = conformance.backend(conformance_backend)
    seqs = [(8, 1), (15, 1), (31, 1), (1, 1)]
    tables = [[7, 2], [0, 5, 9], [3, 4, 6, 8, 12], [1]]
    builder = backend.get_builder_cls()(CASE.block_size)
    step = build_common_metadata(backend, CASE, seqs, tables)
    for ahead in (1, 2):
        step = step.next_decode_step()
        _assert_same(builder.build(step), build_metadata(backend, CASE, [(c + ahead, 1) for c, _ in seqs],
                                                         tables))


def test_builds_from_the_common_description(conformance, conformance_backend):
    """The builder's one call keeps the common tensors as they are (nothing recomputed) and
    needs no host copy of them."""
    backend = conformance.backend(conformance_backend)
    common = build_common_metadata(backend, CASE, CASE.ordered(), TABLES)
    md = backend.get_builder_cls()(CASE.block_size).build(common)
    assert md.slot_mapping is common.slot_mapping and md.block_tables is common.block_table
    assert md.seq_lens_tensor is common.seq_lens and md.query_start_loc is common.query_start_loc
