"""Batches, runs and checks the conformance suite is made of (usable on their own, too).

A :class:`Case` is one batch: per sequence, the tokens already cached (context) and the new
tokens of this step. :func:`run_case` fills each sequence's context through the backend under
test (a prefill step), then runs the batch, and returns the backend's outputs with the
reference's for both steps. Nothing here assumes the backend's KV-cache layout: the backend
owns its cache (``get_kv_cache_shape``), the reference keeps its own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from omniinfer.attention.backend import AttentionBackend, AttentionMetadata
from omniinfer.attention.common import CommonAttentionMetadata, common_for
from omniinfer.attention.reference import ReferenceBackend

TOLERANCE = {torch.float32: 2e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SENTINEL = 7.5


@dataclass(frozen=True)
class Case:
    """One step's batch. `seqs`: (context_len, query_len) per sequence, in any order (prefills
    are put first); a sequence with context and one new token is a decode."""

    name: str
    seqs: tuple[tuple[int, int], ...]
    num_kv_heads: int = 2
    group: int = 2  # query heads per kv head
    head_size: int = 64
    block_size: int = 16
    sliding_window: int | None = None
    seed: int = 0
    query_scale: float = 1.0  # > 1: scores spread far apart (online softmax rescaling)

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    def ordered(self) -> list[tuple[int, int]]:
        decodes = [s for s in self.seqs if s[0] > 0 and s[1] == 1]
        return [s for s in self.seqs if s not in decodes] + decodes


@dataclass
class StepResult:
    label: str
    output: torch.Tensor  # the backend's, [T, heads * head]
    expected: torch.Tensor  # the reference's, same shape
    metadata: AttentionMetadata = field(repr=False)

    def max_error(self) -> float:
        return (self.output.float() - self.expected.float()).abs().max().item() if self.output.numel() else 0.0


def _tables(case: Case, rng: random.Random) -> tuple[list[list[int]], int]:
    """Disjoint, shuffled block tables (so a wrong table or offset reads someone else's keys)."""
    need = [-(-(c + q) // case.block_size) for c, q in case.ordered()]
    num_blocks = sum(need) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for n in need:
        tables.append(pool[:n])
        pool = pool[n:]
    return tables, num_blocks


def build_common_metadata(backend: type[AttentionBackend], case: Case, steps: list[tuple[int, int]],
                          tables: list[list[int]]) -> CommonAttentionMetadata:
    """The step's vendor-neutral description, as the input builder makes it for this backend:
    `steps` is (context_len, query_len) per sequence, in batch order."""
    needs_key_slots = backend.get_builder_cls().needs_prefill_key_slots
    return common_for([(ctx, q, table) for (ctx, q), table in zip(steps, tables)], case.block_size,
                      needs_key_slots)


def build_metadata(backend: type[AttentionBackend], case: Case, steps: list[tuple[int, int]],
                   tables: list[list[int]]) -> AttentionMetadata:
    """The backend's metadata for `steps`: its builder's one call on the common description."""
    builder = backend.get_builder_cls()(case.block_size, case.sliding_window)
    return builder.build(build_common_metadata(backend, case, steps, tables))


def _impl(backend: type[AttentionBackend], case: Case):
    return backend.get_impl_cls()(case.num_heads, case.head_size, case.head_size ** -0.5,
                                  case.num_kv_heads, case.sliding_window)


def run_case(backend: type[AttentionBackend], case: Case, device: torch.device | str,
             dtype: torch.dtype) -> list[StepResult]:
    """Fill the contexts, then run the batch, through `backend` and the reference."""
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed)
    seqs = case.ordered()
    tables, num_blocks = _tables(case, rng)
    caches = {}
    for cls in (backend, ReferenceBackend):
        shape = cls.get_kv_cache_shape(num_blocks, case.block_size, case.num_kv_heads, case.head_size)
        caches[cls] = torch.zeros(shape, dtype=dtype, device=device)
    impls = {cls: _impl(cls, case) for cls in (backend, ReferenceBackend)}
    width = case.head_size
    results = []
    with_context = [(i, c) for i, (c, _) in enumerate(seqs) if c > 0]
    steps = []
    if with_context:
        steps.append(("context", [(0, c) for _, c in with_context], [tables[i] for i, _ in with_context]))
    steps.append((case.name, seqs, tables))
    for label, batch, batch_tables in steps:
        num_tokens = sum(q for _, q in batch)
        q, k, v = (torch.randn(num_tokens, n * width, generator=gen).to(dtype).to(device)
                   for n in (case.num_heads, case.num_kv_heads, case.num_kv_heads))
        q = q * case.query_scale if case.query_scale != 1.0 else q
        outs, metadata = {}, None
        for cls, impl in impls.items():
            md = build_metadata(cls, case, batch, batch_tables)
            metadata = md if cls is backend else metadata
            outs[cls] = impl.forward(q, k, v, caches[cls], md.to(device))
        results.append(StepResult(label, outs[backend], outs[ReferenceBackend], metadata))
    return results


def assert_matches_reference(results: list[StepResult], dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    for r in results:
        assert r.output.shape == r.expected.shape, f"{r.label}: shape {tuple(r.output.shape)}"
        torch.testing.assert_close(r.output.float().cpu(), r.expected.float().cpu(), atol=tol,
                                   rtol=tol, msg=lambda m, r=r: f"step {r.label!r}: {m}")


def count_writes(backend: type[AttentionBackend], case: Case, device, dtype,
                 padding_rows: int = 0) -> tuple[int, int, bool]:
    """Run one step of `case` on a cache full of a sentinel value; with `padding_rows`, that many extra
    decode rows whose slot is -1 are appended. Returns (elements changed, elements the real
    tokens own, whether the default layout holds each token's key and value at its slot)."""
    rng = random.Random(case.seed)
    gen = torch.Generator().manual_seed(case.seed + 1)
    seqs = case.ordered() + [(1, 1)] * padding_rows
    tables, num_blocks = _tables(Case(case.name, tuple(seqs), block_size=case.block_size), rng)
    shape = backend.get_kv_cache_shape(num_blocks, case.block_size, case.num_kv_heads, case.head_size)
    # a sentinel no written key or value can equal, even after rounding to bfloat16
    cache = torch.full(shape, SENTINEL, dtype=dtype, device=device)
    before = cache.clone()
    md = build_metadata(backend, case, seqs, tables)
    num_tokens = sum(q for _, q in seqs)
    if padding_rows:
        md.slot_mapping[num_tokens - padding_rows:] = -1
    width = case.head_size
    q, k, v = (torch.randn(num_tokens, n * width, generator=gen).to(dtype).to(device)
               for n in (case.num_heads, case.num_kv_heads, case.num_kv_heads))
    _impl(backend, case).forward(q, k, v, cache, md.to(device))
    changed = int((cache != before).sum())
    real = num_tokens - padding_rows
    owned = 2 * real * case.num_kv_heads * case.head_size
    in_place = False
    if shape == ReferenceBackend.get_kv_cache_shape(num_blocks, case.block_size,
                                                    case.num_kv_heads, case.head_size):
        flat = cache.view(2, -1, case.num_kv_heads, case.head_size)
        slots = md.slot_mapping[:real].to(cache.device)
        in_place = (torch.equal(flat[0][slots], k[:real].view(real, case.num_kv_heads, width))
                    and torch.equal(flat[1][slots], v[:real].view(real, case.num_kv_heads, width)))
    return changed, owned, in_place
