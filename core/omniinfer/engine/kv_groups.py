"""A model whose layers mix sliding-window and full attention keeps its sliding layers' blocks in
a pool of their own, holding for each sequence only the blocks inside the window.

The full-attention layers use the usual `BlockManager` (every block of every sequence). The
sliding layers' pool (`WindowBlockManager`) gives each sequence a table aligned with that one:
logical block j of a sequence is full-pool block `tables[j]` for the full layers and window-pool
block `window_tables[j]` for the sliding ones, or -1 once every query still to come is past its
window (`release_outside_window`: a token at position p sees keys p - window + 1 .. p). Both pools
hash the same prefix blocks, so prefix caching keeps working: a cached prefix of h blocks is
used only as far as the window pool still holds the blocks its window reaches back to.

Swapping is not offered for such a model (a preemption recomputes); forks copy-on-write in both.
"""

from __future__ import annotations

from omniinfer.engine.block_manager import BlockManager
from omniinfer.engine.sequence import Sequence
from omniinfer.kv_window import window_pool_blocks  # noqa: F401 - re-exported

FREED = -1  # a window-table entry whose block went back to the pool


class WindowBlockManager(BlockManager):
    """The sliding layers' blocks: a `BlockManager` whose tables lose their oldest blocks."""

    def __init__(self, block_size: int, num_blocks: int, window: int, enable_caching: bool):
        super().__init__(block_size, num_blocks, 0, enable_caching)
        self.window = window

    def release_outside_window(self, seq: Sequence) -> None:
        """Give back every block no query from `seq.num_computed_tokens` on can see."""
        table = self.tables.get(seq.seq_id)
        if not table:
            return
        first_seen = seq.num_computed_tokens - self.window + 1  # lowest key position still read
        for j in range(min(max(0, first_seen) // self.block_size, len(table))):
            if table[j] != FREED:
                self.pool.release(table[j])
                table[j] = FREED

    def first_needed_block(self, num_tokens: int) -> int:
        """The oldest block a query at position `num_tokens` reads."""
        return max(0, num_tokens - self.window + 1) // self.block_size

    def window_prefix(self, seq: Sequence, num_full_hits: int) -> tuple[int, list[int]]:
        """(blocks of the prefix usable, this pool's table for them): the longest h <= hits whose
        blocks from `first_needed_block(h * block_size)` on are cached here."""
        for h in range(num_full_hits, 0, -1):
            start = self.first_needed_block(h * self.block_size)
            found = [self.pool.lookup(x) for x in seq.block_hashes[start:h]]
            if all(b is not None for b in found):
                return h, [FREED] * start + found
        return 0, []


class HybridBlockManager(BlockManager):
    """The full layers' `BlockManager`, with the sliding layers' `WindowBlockManager` kept in
    step: every allocation, fork and free happens in both; the sizes it reports add the two."""

    def __init__(self, block_size: int, num_device_blocks: int, num_window_blocks: int,
                 window: int, enable_caching: bool, max_step_tokens: int):
        super().__init__(block_size, num_device_blocks, 0, enable_caching)
        self.window = WindowBlockManager(block_size, num_window_blocks, window, enable_caching)
        self.max_step_tokens = max_step_tokens
        self._window_hits: dict[int, list[int]] = {}  # seq_id -> window-table prefix (computed_prefix)
        self.window_copies: list[tuple[int, int]] = []  # copy-on-writes in the window pool this step

    @property
    def window_tables(self) -> dict[int, list[int]]:
        return self.window.tables

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks + self.window.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free + self.window.pool.num_free

    def blocks_short(self, num_tokens: int) -> tuple[int, int] | None:
        need = super().blocks_short(num_tokens)
        if need is not None:
            return need
        held = self.blocks_for(min(num_tokens, self.window.window - 1 + self.max_step_tokens)) + 1
        if held > self.window.pool.num_blocks:
            return held, self.window.pool.num_blocks
        return None

    def can_grow(self, seqs: list[Sequence], num_tokens: int) -> bool:
        return super().can_grow(seqs, num_tokens) and self.window.can_grow(seqs, num_tokens)

    # ---- prefix cache ------------------------------------------------------------------------
    def computed_prefix(self, seq: Sequence) -> list[int]:
        hits = super().computed_prefix(seq)
        num, table = self.window.window_prefix(seq, len(hits))
        self._window_hits[seq.seq_id] = table
        return hits[:num]

    def cache_full_blocks(self, seq: Sequence) -> None:
        super().cache_full_blocks(seq)
        self.window.cache_full_blocks(seq)

    # ---- allocation --------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: list[int] | None = None,
                       copies: list[tuple[int, int]] | None = None) -> bool:
        window_hits = self._window_hits.pop(seq.seq_id, [])[:len(computed or [])]
        self.window.release_outside_window(seq)
        if (self._need(self, seq, num_new_tokens, computed or []) > self.pool.num_free
                or self._need(self.window, seq, num_new_tokens, window_hits) > self.window.pool.num_free):
            return False
        assert super().allocate_slots(seq, num_new_tokens, computed, copies)
        assert self.window.allocate_slots(seq, num_new_tokens, window_hits, self.window_copies)
        return True

    @staticmethod
    def _need(manager: BlockManager, seq: Sequence, num_new_tokens: int, computed: list[int]) -> int:
        """Free blocks `manager.allocate_slots` would take."""
        if seq.seq_id in manager.tables:
            return 0 if manager.has_room(seq, num_new_tokens) else manager.num_blocks_to_add(seq, num_new_tokens)
        revive = sum(1 for b in computed if b != FREED and manager.pool.ref_counts[b] == 0)
        need = manager.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(computed)
        return max(0, need) + revive

    def has_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        return super().has_room(seq, num_new_tokens) and self.window.has_room(seq, num_new_tokens)

    def num_blocks_to_add(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(super().num_blocks_to_add(seq, num_new_tokens),
                   self.window.num_blocks_to_add(seq, num_new_tokens))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        self.window.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self.window.free(seq)
        self._window_hits.pop(seq.seq_id, None)

    def can_swap_out(self, seq: Sequence) -> bool:
        return False  # preemption recomputes (the window pool has no host copy)

    def held_blocks(self, seq: Sequence) -> tuple[int, int]:
        """(full-pool blocks, window-pool blocks) the sequence holds."""
        window = self.window.tables.get(seq.seq_id, [])
        return len(self.tables.get(seq.seq_id, [])), sum(1 for b in window if b != FREED)

