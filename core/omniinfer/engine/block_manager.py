"""The paged KV cache's bookkeeping: pure Python over block ids.

Device blocks live in a `BlockPool` (ref counts, an LRU free queue, prefix-cache hashes);
host blocks for swapped-out sequences live in a plain free list. The `BlockManager` keeps
one block table (list of device block ids) per running sequence. Nothing here touches a
tensor: the scheduler turns its answers into lists of block copies for the worker.
"""

from __future__ import annotations

from collections import OrderedDict

from omniinfer.engine.sequence import Sequence


class BlockPool:
    """Device blocks: reference counts, a free queue in eviction order, content hashes.

    A block whose count drops to 0 goes to the back of the free queue but keeps its hash, so
    a later request with the same prefix can revive it; allocation takes the front
    (least recently freed) and forgets its hash then.
    """

    def __init__(self, num_blocks: int, enable_caching: bool):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # content hash -> block id
        self.num_hits = 0
        self.num_queries = 0

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        old = self.block_hash[block]
        if old is not None:  # evict: the content is about to be overwritten
            if self.cached.get(old) == block:
                del self.cached[old]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def acquire(self, block: int) -> None:
        """One more owner for a block (a prefix-cache hit or a fork)."""
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} freed twice"
        if self.ref_counts[block] == 0:
            if self.block_hash[block] is None:
                self.free_queue[block] = None
                self.free_queue.move_to_end(block, last=False)  # no content worth keeping: reuse first
            else:
                self.free_queue[block] = None

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash)

    def register(self, block: int, block_hash: int) -> None:
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash


class BlockManager:
    """Block tables for sequences over a device pool and a host (swap) pool."""

    def __init__(self, block_size: int, num_device_blocks: int, num_host_blocks: int,
                 enable_caching: bool = False):
        self.block_size = block_size
        self.pool = BlockPool(num_device_blocks, enable_caching)
        self.host_free = list(range(num_host_blocks - 1, -1, -1))
        self.num_host_blocks = num_host_blocks
        self.tables: dict[int, list[int]] = {}  # seq_id -> device block ids
        self.host_tables: dict[int, list[int]] = {}  # seq_id -> host block ids (swapped out)
        self.num_registered: dict[int, int] = {}  # seq_id -> leading blocks already hashed

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_short(self, num_tokens: int) -> tuple[int, int] | None:
        """(blocks needed, blocks there are) when one sequence of `num_tokens` could never fit."""
        need = self.blocks_for(num_tokens)
        return (need, self.num_total_blocks) if need > self.num_total_blocks else None

    def can_grow(self, seqs: list[Sequence], num_tokens: int) -> bool:
        """Whether every sequence of `seqs` can get room for `num_tokens` more at once."""
        return sum(self.num_blocks_to_add(seq, num_tokens) for seq in seqs) <= self.num_free_blocks

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables[seq.seq_id]

    # ---- prefix cache -----------------------------------------------------------------------------
    def computed_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding this sequence's leading full blocks. At least one token is
        always left to compute, so the step that computes it can produce logits."""
        if not self.pool.enable_caching:
            return []
        usable = (seq.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in seq.block_hashes[:usable]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.pool.num_queries += usable
        self.pool.num_hits += len(hits)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the content hash of every block this sequence has fully computed."""
        if not self.pool.enable_caching:
            return
        table = self.tables[seq.seq_id]
        done = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        for i in range(self.num_registered.get(seq.seq_id, 0), done):
            if table[i] >= 0:  # (-1: a block a window pool gave back, engine/kv_groups.py)
                self.pool.register(table[i], seq.block_hashes[i])
        self.num_registered[seq.seq_id] = max(done, self.num_registered.get(seq.seq_id, 0))

    # ---- allocation ---------------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, computed: list[int] | None = None,
                       copies: list[tuple[int, int]] | None = None) -> bool:
        """Make room for `num_new_tokens` after `seq.num_computed_tokens` (for a new sequence,
        `computed` are its prefix-cache hits). Copy-on-write of a shared last block is appended
        to `copies` as (src, dst). False, and nothing changed, when blocks run short."""
        if not computed and self.has_room(seq, num_new_tokens):
            return True
        table = self.tables.get(seq.seq_id)
        is_new = table is None
        if is_new:
            computed = computed or []
            table = []
        elif computed:
            raise AssertionError("prefix hits only apply to a sequence without blocks")
        have = len(table) + (len(computed) if is_new else 0)
        need_total = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        num_new_blocks = max(0, need_total - have)
        revive = sum(1 for b in computed if b >= 0 and self.pool.ref_counts[b] == 0) if is_new else 0
        cow = self._needs_cow(table, seq.num_computed_tokens) if not is_new else False
        if num_new_blocks + revive + int(cow) > self.pool.num_free:
            return False
        if is_new:
            for b in computed:
                if b >= 0:
                    self.pool.acquire(b)
            table = list(computed)
            self.tables[seq.seq_id] = table
            self.num_registered[seq.seq_id] = len(computed)
        if cow:
            i = seq.num_computed_tokens // self.block_size
            src = table[i]
            dst = self.pool.allocate()
            self.pool.release(src)
            table[i] = dst
            if copies is not None:
                copies.append((src, dst))
        for _ in range(num_new_blocks):
            table.append(self.pool.allocate())
        return True

    def has_room(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the sequence's blocks already hold `num_new_tokens` more and the block it
        writes first is its own (no allocation, no copy-on-write needed)."""
        table = self.tables.get(seq.seq_id)
        if table is None:
            return False
        bs, done = self.block_size, seq.num_computed_tokens
        return done + num_new_tokens <= len(table) * bs and (
            done % bs == 0 or self.pool.ref_counts[table[done // bs]] == 1)

    def num_blocks_to_add(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks `allocate_slots` would take to give a sequence that already has blocks
        room for `num_new_tokens` more (new blocks, plus one for a copy-on-write)."""
        table, done = self.tables[seq.seq_id], seq.num_computed_tokens
        return (max(0, self.blocks_for(done + num_new_tokens) - len(table))
                + int(self._needs_cow(table, done)))

    def _needs_cow(self, table: list[int], num_computed: int) -> bool:
        i = num_computed // self.block_size
        return (num_computed % self.block_size != 0 and i < len(table)
                and self.pool.ref_counts[table[i]] > 1)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares the blocks holding the parent's cached tokens (not any lookahead
        blocks reserved past them, which only the parent may write)."""
        table = self.tables[parent.seq_id][: self.blocks_for(parent.num_computed_tokens)]
        for b in table:
            if b >= 0:
                self.pool.acquire(b)
        self.tables[child.seq_id] = table
        self.num_registered[child.seq_id] = self.num_registered.get(parent.seq_id, 0)

    def free(self, seq: Sequence) -> None:
        """Give back everything the sequence holds (device and host). Unknown ids are a no-op."""
        for b in reversed(self.tables.pop(seq.seq_id, [])):
            if b >= 0:
                self.pool.release(b)
        self.host_free.extend(self.host_tables.pop(seq.seq_id, []))
        self.num_registered.pop(seq.seq_id, None)

    # ---- swapping --------------------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(self.tables.get(seq.seq_id, [])) <= len(self.host_free)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's blocks to host blocks; returns (device, host) copies."""
        mapping = []
        host = []
        for b in self.tables.pop(seq.seq_id):
            h = self.host_free.pop()
            mapping.append((b, h))
            host.append(h)
            self.pool.release(b)
        self.host_tables[seq.seq_id] = host
        self.num_registered.pop(seq.seq_id, None)
        return mapping

    def can_swap_in(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(need, len(self.host_tables[seq.seq_id])) <= self.pool.num_free

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back; returns (host, device) copies."""
        mapping = []
        table = []
        for h in self.host_tables.pop(seq.seq_id):
            b = self.pool.allocate()
            mapping.append((h, b))
            table.append(b)
            self.host_free.append(h)
        self.tables[seq.seq_id] = table
        self.num_registered[seq.seq_id] = 0
        return mapping

    # ---- stats ---------------------------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """Fraction of device blocks in use (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / max(1, self.pool.num_blocks)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.pool.num_hits / self.pool.num_queries if self.pool.num_queries else 0.0
