"""The block manager: pure Python over block ids; every workload returns every block."""

from __future__ import annotations

import random

import pytest

from omniinfer.engine.block_manager import BlockManager
from omniinfer.engine.sequence import Sequence, SequenceGroup
from omniinfer.sampling.params import SamplingParams

BS = 4


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    group = SequenceGroup(f"r{seq_id}", None, list(tokens), SamplingParams())
    seq = Sequence(seq_id, group, 0, list(tokens), len(tokens), BS)
    group.seqs.append(seq)
    return seq


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """What the engine does after a step: the tokens are now in the cache."""
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def test_allocate_and_free_returns_everything():
    bm = BlockManager(BS, num_device_blocks=8, num_host_blocks=0)
    seq = make_seq(0, list(range(10)))
    assert bm.allocate_slots(seq, 10)
    assert len(bm.block_table(seq)) == 3 and bm.num_free_blocks == 5
    compute(bm, seq, 10)
    seq.append_token(99)
    assert bm.allocate_slots(seq, 1)  # slot 10 fits in block 2
    assert bm.num_free_blocks == 5
    compute(bm, seq, 1)
    seq.append_token(98)
    seq.append_token(97)
    assert bm.allocate_slots(seq, 2)  # slots 11, 12: a new block for 12
    assert bm.num_free_blocks == 4
    bm.free(seq)
    assert bm.num_free_blocks == 8
    bm.free(seq)  # unknown / already freed: no-op
    assert bm.num_free_blocks == 8


def test_allocation_fails_without_changes_when_short():
    bm = BlockManager(BS, num_device_blocks=2, num_host_blocks=0)
    seq = make_seq(0, list(range(12)))
    assert not bm.allocate_slots(seq, 12)
    assert bm.num_free_blocks == 2 and seq.seq_id not in bm.tables


def test_fork_shares_blocks_and_copy_on_write_on_partial_last_block():
    bm = BlockManager(BS, num_device_blocks=8, num_host_blocks=0)
    parent = make_seq(0, list(range(6)))  # blocks: [0..3] full, [4, 5] partial
    assert bm.allocate_slots(parent, 6)
    compute(bm, parent, 6)
    child = parent.fork(1, 1)
    bm.fork(parent, child)
    assert bm.block_table(child) == bm.block_table(parent)
    assert bm.num_free_blocks == 6
    parent.append_token(50)
    child.append_token(60)
    copies: list[tuple[int, int]] = []
    assert bm.allocate_slots(parent, 1, copies=copies)
    shared_last = bm.block_table(child)[1]
    assert copies == [(shared_last, bm.block_table(parent)[1])]
    assert bm.block_table(parent)[0] == bm.block_table(child)[0]  # full block still shared
    copies.clear()
    assert bm.allocate_slots(child, 1, copies=copies)
    assert copies == []  # the child is now the only owner: writes in place
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_prefix_cache_hits_revive_and_evict_lru():
    bm = BlockManager(BS, num_device_blocks=6, num_host_blocks=0, enable_caching=True)
    a = make_seq(0, list(range(9)))  # two full blocks + 1
    assert bm.allocate_slots(a, 9)
    compute(bm, a, 9)
    a_blocks = list(bm.block_table(a))
    bm.free(a)
    assert bm.num_free_blocks == 6  # cached blocks count as free
    b = make_seq(1, list(range(8)) + [77, 78])
    hits = bm.computed_prefix(b)
    assert hits == a_blocks[:2]
    assert bm.allocate_slots(b, 2, computed=hits)
    assert bm.block_table(b)[:2] == a_blocks[:2]
    # a full-prompt hit still leaves one token to compute
    c = make_seq(2, list(range(8)))
    assert len(bm.computed_prefix(c)) == 1
    bm.free(b)
    # allocating everything evicts the cached blocks; the hash map forgets them
    d = make_seq(3, list(range(100, 124)))
    assert bm.allocate_slots(d, 24)
    assert bm.computed_prefix(make_seq(4, list(range(9)))) == []
    bm.free(d)
    assert bm.num_free_blocks == 6


def test_swap_out_and_in_round_trip():
    bm = BlockManager(BS, num_device_blocks=4, num_host_blocks=4)
    seq = make_seq(0, list(range(7)))
    assert bm.allocate_slots(seq, 7)
    compute(bm, seq, 7)
    device = list(bm.block_table(seq))
    assert bm.can_swap_out(seq)
    out = bm.swap_out(seq)
    assert [d for d, _ in out] == device and bm.num_free_blocks == 4
    assert bm.can_swap_in(seq, 1)
    back = bm.swap_in(seq)
    assert [h for h, _ in back] == [h for _, h in out]
    assert len(bm.block_table(seq)) == 2 and bm.num_free_blocks == 2
    bm.free(seq)
    assert bm.num_free_blocks == 4 and len(bm.host_free) == 4


@pytest.mark.parametrize("caching", [False, True])
def test_random_workload_never_leaks(caching):
    rng = random.Random(0)
    bm = BlockManager(BS, num_device_blocks=32, num_host_blocks=16, enable_caching=caching)
    live: list[Sequence] = []
    swapped: list[Sequence] = []
    for step in range(600):
        action = rng.random()
        if action < 0.3:
            seq = make_seq(step, [rng.randrange(4) for _ in range(rng.randrange(1, 14))])
            hits = bm.computed_prefix(seq)
            seq.num_computed_tokens = len(hits) * BS
            if bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens, computed=hits):
                compute(bm, seq, seq.num_tokens - seq.num_computed_tokens)
                live.append(seq)
        elif action < 0.6 and live:
            seq = rng.choice(live)
            seq.append_token(rng.randrange(4))
            if bm.allocate_slots(seq, 1):
                compute(bm, seq, 1)
            else:
                seq.token_ids.pop()
        elif action < 0.7 and live:
            parent = rng.choice(live)
            child = parent.fork(10_000 + step, 1)
            bm.fork(parent, child)
            live.append(child)
        elif action < 0.8 and live:
            seq = live.pop(rng.randrange(len(live)))
            if bm.can_swap_out(seq):
                bm.swap_out(seq)
                swapped.append(seq)
            else:
                bm.free(seq)
        elif action < 0.85 and swapped:
            seq = swapped[0]
            if bm.can_swap_in(seq, 0):
                bm.swap_in(swapped.pop(0))
                live.append(seq)
        elif live:
            bm.free(live.pop(rng.randrange(len(live))))
        refs = sum(bm.pool.ref_counts)
        assert refs == sum(len(bm.tables[s.seq_id]) for s in live)
        assert bm.num_free_blocks + sum(1 for c in bm.pool.ref_counts if c) == 32
    for seq in live + swapped:
        bm.free(seq)
    assert bm.num_free_blocks == 32 and len(bm.host_free) == 16
    assert all(c == 0 for c in bm.pool.ref_counts)
