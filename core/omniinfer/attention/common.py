"""The one vendor-neutral description of a step's batch, built once, and its numpy helpers.

The input builder describes every step as a :class:`CommonAttentionMetadata` (query starts,
lengths, positions, slot mapping, block table, the prefill/decode split and, for backends that
ask, the slot of every prefill key). A backend's metadata builder turns it into its own
metadata in one call (``build(common)``); multi-step decoding and speculative drafting advance
this object (``next_decode_step``) and call the builder again, so no backend advances anything.

Batch layout: prefill sequences first, decodes after (a "decode" has one new token and
something cached before it); tokens flattened in that order.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch


def positions_for(context_lens: np.ndarray, query_lens: np.ndarray) -> np.ndarray:
    """Absolute positions of every new token, flattened: ctx_i, ..., ctx_i + q_i - 1 per sequence."""
    total = int(query_lens.sum())
    starts = np.cumsum(query_lens) - query_lens
    return np.arange(total, dtype=np.int64) + np.repeat(context_lens - starts, query_lens)


def padded_block_tables(block_tables: list[list[int]], min_width: int = 1) -> np.ndarray:
    """[num_seqs, max_blocks] int32, each row padded with 0 (never read past seq_len)."""
    lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
    width = max(min_width, int(lens.max()) if len(lens) else 0)
    out = np.zeros((len(block_tables), width), dtype=np.int32)
    total = int(lens.sum())
    if total:
        flat = np.fromiter(chain.from_iterable(block_tables), dtype=np.int32, count=total)
        rows = np.repeat(np.arange(len(lens)), lens)
        cols = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
        out[rows, cols] = flat
    return out


def slot_mapping_for(tables: np.ndarray, context_lens: np.ndarray, query_lens: np.ndarray,
                     block_size: int) -> np.ndarray:
    """Cache slot of every new token: block_tables[seq, pos // block_size] * block_size + pos % block_size."""
    positions = positions_for(context_lens, query_lens)
    seq_index = np.repeat(np.arange(len(query_lens)), query_lens)
    blocks = tables[seq_index, positions // block_size].astype(np.int64)
    return blocks * block_size + positions % block_size


def key_slots_for(tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of every key of every sequence (positions 0 .. seq_len - 1), flattened in
    sequence order: what a kernel without paged-KV support gathers into contiguous keys."""
    return slot_mapping_for(tables, np.zeros_like(seq_lens), seq_lens, block_size)


def sliding_window_start(seq_len: int, window: int | None) -> int:
    """First key position the last query of a sequence may see (0 without a window)."""
    return 0 if not window else max(0, seq_len - window)


@dataclass(slots=True)
class CommonAttentionMetadata:
    """One step's batch for every backend. Tensors live on one device (the CPU when built);
    the ints and lists are host copies, so nothing here needs a device-to-host copy."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: tokens in the cache after this step
    context_lens: torch.Tensor  # [num_seqs] int32: tokens cached before this step
    positions: torch.Tensor  # [num_tokens] int64: absolute position of every new token
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset)
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    num_prefills: int  # the first num_prefills sequences are prefills, the rest decodes
    num_prefill_tokens: int
    seq_lens_host: list[int]
    query_lens_host: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # [sum of the prefills' seq_lens] int64: the slot of every key of every prefill, in order;
    # only for builders that set `needs_prefill_key_slots` (kernels taking contiguous keys)
    prefill_key_slots: torch.Tensor | None = None
    # models mixing sliding-window and full-attention layers (the window pool, engine/kv_groups.py):
    # the sliding layers' own block table and slots (None: every layer uses block_table)
    window_block_table: torch.Tensor | None = None  # [num_seqs, max_blocks] int32, 0 where freed
    window_slot_mapping: torch.Tensor | None = None  # [num_tokens] int64

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_decode_tokens(self) -> int:
        return self.num_tokens - self.num_prefill_tokens

    @property
    def max_prefill_context_len(self) -> int:
        """The longest cached context among the prefills (0: none, or no prefill)."""
        n = self.num_prefills
        return max((s - q for s, q in zip(self.seq_lens_host[:n], self.query_lens_host[:n])),
                   default=0)

    def next_decode_step(self) -> CommonAttentionMetadata:
        """Decode-only: one token after each sequence's last (multi-step decoding, drafting).
        Made from this object's device tensors and host lists, with no copy back to the host;
        the block table must already hold the new positions (the scheduler reserved them)."""
        num_seqs, device = self.num_seqs, self.seq_lens.device
        positions = self.seq_lens.long()  # the next position of each sequence
        rows = self.block_table.gather(1, (positions // self.block_size)[:, None])[:, 0].long()
        seq_lens_host = [n + 1 for n in self.seq_lens_host]
        window_slots = None
        if self.window_block_table is not None:
            window_rows = self.window_block_table.gather(1, (positions // self.block_size)[:, None])[:, 0]
            window_slots = window_rows.long() * self.block_size + positions % self.block_size
        return CommonAttentionMetadata(
            query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
            seq_lens=self.seq_lens + 1, context_lens=self.seq_lens.clone(), positions=positions,
            slot_mapping=rows * self.block_size + positions % self.block_size,
            block_table=self.block_table, num_prefills=0, num_prefill_tokens=0,
            seq_lens_host=seq_lens_host, query_lens_host=[1] * num_seqs, max_query_len=1,
            max_seq_len=self.max_seq_len + 1, block_size=self.block_size,
            prefill_key_slots=None if self.prefill_key_slots is None else self.prefill_key_slots[:0],
            window_block_table=self.window_block_table, window_slot_mapping=window_slots)

    def to(self, device: torch.device | str) -> CommonAttentionMetadata:
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return CommonAttentionMetadata(
            move(self.query_start_loc), move(self.seq_lens), move(self.context_lens),
            move(self.positions), move(self.slot_mapping), move(self.block_table),
            self.num_prefills, self.num_prefill_tokens, self.seq_lens_host, self.query_lens_host,
            self.max_query_len, self.max_seq_len, self.block_size, move(self.prefill_key_slots),
            move(self.window_block_table), move(self.window_slot_mapping))


def build_common(context_lens: list[int], query_lens: list[int], block_tables: list[list[int]],
                 num_prefills: int, block_size: int, prefill_key_slots: bool = False,
                 window_block_tables: list[list[int]] | None = None) -> CommonAttentionMetadata:
    """The batch's description, with every tensor on the CPU: per sequence (prefills first) the
    tokens cached before the step, the new tokens, and the block table (and the sliding
    layers' block table, where the model keeps its windows apart: -1 marks a freed block)."""
    ctx = np.asarray(context_lens, dtype=np.int64)
    q = np.asarray(query_lens, dtype=np.int64)
    seq_lens = ctx + q
    tables = padded_block_tables(block_tables)
    qsl = np.zeros(len(q) + 1, dtype=np.int32)
    np.cumsum(q, out=qsl[1:])
    positions = positions_for(ctx, q)
    seq_index = np.repeat(np.arange(len(q)), q)
    slots = tables[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size
    key_slots = None
    if prefill_key_slots:
        n = num_prefills
        key_slots = torch.from_numpy(key_slots_for(tables[:n], seq_lens[:n], block_size))
    seq_lens_host = seq_lens.tolist()
    window_table = window_slots = None
    if window_block_tables:
        wt = np.maximum(padded_block_tables(window_block_tables, tables.shape[1]), 0)
        window_slots = torch.from_numpy(wt[seq_index, positions // block_size].astype(np.int64) * block_size
                                        + positions % block_size)
        window_table = torch.from_numpy(wt)
    return CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
        context_lens=torch.from_numpy(ctx.astype(np.int32)), positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slots), block_table=torch.from_numpy(tables),
        num_prefills=num_prefills, num_prefill_tokens=int(qsl[num_prefills]),
        seq_lens_host=seq_lens_host, query_lens_host=list(query_lens),
        max_query_len=max(query_lens, default=0), max_seq_len=max(seq_lens_host, default=0),
        block_size=block_size, prefill_key_slots=key_slots, window_block_table=window_table,
        window_slot_mapping=window_slots)


def common_for(seqs: list[tuple[int, int, list[int]]], block_size: int,
               prefill_key_slots: bool = False) -> CommonAttentionMetadata:
    """`build_common` for a list of (context_len, query_len, block_table), in batch order (the
    prefills, then the decodes: one new token after a cached context). For tests and tools."""
    num_prefills = sum(1 for ctx, q, _ in seqs if not (ctx > 0 and q == 1))
    assert all(not (ctx > 0 and q == 1) for ctx, q, _ in seqs[:num_prefills]), \
        "prefills must come before decodes"
    return build_common([s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs],
                        num_prefills, block_size, prefill_key_slots)
