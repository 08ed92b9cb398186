"""Sliding-window layers in a pool of their own (engine/kv_groups.py): a sequence holds only the
window-pool blocks its window still reaches, prefix hits are cut where the window pool no longer
holds what they need, forks share and copy-on-write in both pools, every block comes back; and a
Gemma-shaped engine keeps its sliding layers' KV within the window, transformers-identical."""

from __future__ import annotations

import random

from test_block_manager import BS, compute, make_seq
from test_parity import check_parity, make_prompts

from omniinfer import SamplingParams
from omniinfer.engine.kv_groups import FREED, HybridBlockManager, window_pool_blocks

WINDOW = 6  # a query sees itself and the 5 keys before it


def manager(num_blocks: int = 16, window_blocks: int = 8, caching: bool = False) -> HybridBlockManager:
    return HybridBlockManager(BS, num_blocks, window_blocks, WINDOW, caching, max_step_tokens=8)


def decode(bm: HybridBlockManager, seq, n: int) -> None:
    for _ in range(n):
        seq.append_token(7)
        assert bm.allocate_slots(seq, 1)
        compute(bm, seq, 1)


def test_old_blocks_go_back_as_the_sequence_grows():
    bm = manager()
    seq = make_seq(0, list(range(10)))
    assert bm.allocate_slots(seq, 10)
    compute(bm, seq, 10)
    assert bm.held_blocks(seq) == (3, 3)
    decode(bm, seq, 14)  # the last allocation was for position 23, which reads keys 18..23
    assert bm.held_blocks(seq) == (6, 2)
    assert bm.window_tables[seq.seq_id][:4] == [FREED] * 4
    assert all(b >= 0 for b in bm.window_tables[seq.seq_id][4:])
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_total_blocks == 16 + 8


def test_allocation_fails_whole_when_either_pool_is_short():
    bm = manager(num_blocks=16, window_blocks=3)
    a, b = make_seq(0, list(range(8))), make_seq(1, list(range(8)))
    assert bm.allocate_slots(a, 8)
    assert not bm.allocate_slots(b, 8)  # the window pool has 1 block left
    assert bm.num_free_blocks == (16 - 2) + (3 - 2) and b.seq_id not in bm.tables
    assert manager(num_blocks=2000).blocks_short(4096) is None  # the window pool: a window's worth
    assert manager(window_blocks=2).blocks_short(12) == (4, 2)


def test_prefix_hits_stop_where_the_window_pool_no_longer_holds_them():
    bm = manager(num_blocks=32, window_blocks=5, caching=True)
    prompt = list(range(100, 124))  # 6 full blocks
    first = make_seq(0, prompt)
    for _ in range(3):  # chunks of 8: the window pool recycles (and forgets) the oldest blocks
        assert bm.allocate_slots(first, 8)
        compute(bm, first, 8)
    decode(bm, first, 16)  # ... and, by now, the blocks of the whole prompt
    second = make_seq(1, prompt + [5, 6])
    # the full pool holds all 6 prompt blocks; a hit of h blocks needs the window pool to hold
    # the blocks of positions 4h - 5 .. 4h - 1 still: none does, so nothing is reused
    assert bm.computed_prefix(second) == []
    bm.free(first)
    third = make_seq(2, list(range(100, 116)) + [1, 2, 3, 4, 5])  # first's tokens 0..15, then others
    for n in (16, 5):
        assert bm.allocate_slots(third, n)
        compute(bm, third, n)
    fourth = make_seq(3, prompt[:16] + [9])
    hits = bm.computed_prefix(fourth)  # blocks 2 and 3 of `third` are in the window pool
    assert len(hits) == 4
    fourth.num_computed_tokens = 16
    assert bm.allocate_slots(fourth, 1, hits)
    assert bm.window_tables[3][2:4] == bm.window_tables[2][2:4]
    for seq in (second, third, fourth):
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_a_hit_in_both_pools_shares_the_blocks():
    bm = manager(num_blocks=32, window_blocks=16, caching=True)
    prompt = list(range(200, 216))  # 4 full blocks
    first = make_seq(0, prompt + [1])
    assert bm.allocate_slots(first, 17)
    compute(bm, first, 17)
    second = make_seq(1, prompt + [2])
    hits = bm.computed_prefix(second)
    assert hits == bm.tables[0][:4]
    second.num_computed_tokens = 16
    assert bm.allocate_slots(second, 1, hits)
    # the window pool shares the blocks a query at position 16 reads (keys 11..16: blocks 2, 3)
    assert bm.window_tables[1][:4] == [FREED, FREED] + bm.window_tables[0][2:4]
    for seq in (first, second):
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_fork_shares_both_pools_and_copies_on_write():
    bm = manager()
    parent = make_seq(0, list(range(6)))
    assert bm.allocate_slots(parent, 6)
    compute(bm, parent, 6)
    child = make_seq(1, list(range(6)))
    child.num_computed_tokens = 6
    bm.fork(parent, child)
    child.append_token(9)
    copies = []
    assert bm.allocate_slots(child, 1, copies=copies)  # block 1 is shared: copied in both pools
    assert len(copies) == 1 and len(bm.window_copies) == 1
    for seq in (parent, child):
        bm.free(seq)
    assert bm.num_free_blocks == bm.num_total_blocks


def test_window_pool_size():
    # 64 sequences, window 512, 2048-token steps, blocks of 16: 32 + 128 + 1 blocks each
    assert window_pool_blocks(100_000, 16, 512, 64, 2048) == 64 * 161
    assert window_pool_blocks(1_000, 16, 512, 64, 2048) == 1_000


def test_gemma3_engine_keeps_only_the_window(checkpoint_dir, hf_greedy):
    """A 300-token sequence on the tiny Gemma 3 (window 8, blocks of 4): the sliding layers hold
    3 or 4 blocks, the global layer all 75; tokens equal transformers'."""
    path = checkpoint_dir("gemma3")
    prompt = make_prompts(300, [100], seed=9)[0]
    llm = check_parity(path, hf_greedy, [prompt], max_tokens=200, block_size=4, num_kv_blocks=96,
                       max_num_seqs=2, max_num_batched_tokens=16, enable_chunked_prefill=True)
    engine = llm.llm_engine
    blocks = engine.scheduler.blocks
    assert isinstance(blocks, HybridBlockManager)
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=200, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.seqs.values():
            held.append(blocks.held_blocks(seq))
    assert max(w for _, w in held) <= 2 + 4 + 1  # a window (8 keys) and a 16-token chunk
    assert max(f for f, _ in held) >= 70


def test_prefix_caching_and_forks_with_a_window_pool(checkpoint_dir, hf_greedy):
    path = checkpoint_dir("gemma2")
    rng = random.Random(11)
    prefix = [rng.randrange(3, 300) for _ in range(30)]
    prompts = [prefix + p for p in make_prompts(300, [1, 6, 13], seed=3)]
    llm = check_parity(path, hf_greedy, prompts[:1], max_tokens=20, block_size=4, num_kv_blocks=96,
                       enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 20) for p in prompts[1:]]
    assert llm.llm_engine.stats()["prefix_cache_hit_rate"] > 0.5
    params = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [hf_greedy(path, prompts[1], 12)] * 2
    stats = llm.llm_engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"]


def test_swap_preemption_recomputes_with_a_window_pool(checkpoint_dir, hf_greedy):
    llm = check_parity(checkpoint_dir("gemma2"), hf_greedy, make_prompts(300, [9, 17, 20, 12, 25]),
                       max_tokens=16, block_size=8, num_kv_blocks=14, preemption_mode="swap",
                       swap_space=0.01)
    assert llm.llm_engine.stats()["num_preemptions"] > 0
