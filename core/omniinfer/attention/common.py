"""Helpers shared by the metadata builders: slot mapping, padded block tables, lengths.

Everything here is numpy on the host; the result is a set of CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from omniinfer.attention.backend import AttentionMetadata, AttentionMetadataBuilder


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


def sliding_window_start(seq_len: int, window: int | None) -> int:
    """First key position the last query of a sequence may see (0 without a window)."""
    return 0 if not window else max(0, seq_len - window)


class CommonMetadataState:
    """Collects per-sequence data and builds the common :class:`AttentionMetadata` fields."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.context_lens: list[int] = []
        self.query_lens: list[int] = []
        self.block_tables: list[list[int]] = []
        self.num_prefills = 0
        self.num_prefill_tokens = 0

    def add(self, context_len: int, query_len: int, block_table: list[int], is_prefill: bool) -> None:
        if is_prefill:
            assert self.num_prefills == len(self.query_lens), "prefills must come before decodes"
            self.num_prefills += 1
            self.num_prefill_tokens += query_len
        self.context_lens.append(context_len)
        self.query_lens.append(query_len)
        self.block_tables.append(block_table)

    def add_decodes(self, context_lens: list[int], block_tables: list[list[int]]) -> None:
        self.context_lens += context_lens
        self.query_lens += [1] * len(context_lens)
        self.block_tables += block_tables

    def arrays(self) -> dict[str, np.ndarray]:
        ctx = np.asarray(self.context_lens, dtype=np.int64)
        q = np.asarray(self.query_lens, dtype=np.int64)
        tables = padded_block_tables(self.block_tables)
        qsl = np.zeros(len(q) + 1, dtype=np.int32)
        np.cumsum(q, out=qsl[1:])
        return dict(context_lens=ctx, query_lens=q, seq_lens=ctx + q, block_tables=tables,
                    query_start_loc=qsl,
                    slot_mapping=slot_mapping_for(tables, ctx, q, self.block_size))

    def common_fields(self) -> dict:
        a = self.arrays()
        seq_lens = a["seq_lens"].tolist()
        query_lens = self.query_lens
        return dict(
            num_prefills=self.num_prefills,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=int(a["query_lens"].sum()) - self.num_prefill_tokens,
            slot_mapping=torch.from_numpy(a["slot_mapping"]),
            seq_lens=seq_lens,
            seq_lens_tensor=torch.from_numpy(a["seq_lens"].astype(np.int32)),
            query_lens=list(query_lens),
            context_lens_tensor=torch.from_numpy(a["context_lens"].astype(np.int32)),
            query_start_loc=torch.from_numpy(a["query_start_loc"]),
            block_tables=torch.from_numpy(a["block_tables"]),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )

    def build(self, metadata_cls):
        return metadata_cls(**self.common_fields())


def key_slots_for(tables: np.ndarray, seq_lens: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of every key of every sequence (positions 0 .. seq_len - 1), flattened in
    sequence order: what a kernel without paged-KV support gathers into contiguous keys."""
    return slot_mapping_for(tables, np.zeros_like(seq_lens), seq_lens, block_size)


@dataclass
class PrefillKeySlotsMetadata(AttentionMetadata):
    """Common metadata plus the slots of every cached key of the prefills (for backends whose
    prefill kernel takes contiguous keys: xFormers, CK flash attention on ROCm)."""

    prefill_key_slots: torch.Tensor  # [sum of prefill seq_lens] int64, prefills in order
    max_prefill_context_len: int  # host: longest cached context among prefills (0: none)

    def slice_fields(self, s0: int, s1: int, t0: int, t1: int) -> dict:
        if s0 == 0:
            return {}
        return dict(prefill_key_slots=self.prefill_key_slots[:0], max_prefill_context_len=0)

    def decode_step_fields(self, values: dict) -> dict:
        return dict(prefill_key_slots=self.prefill_key_slots[:0], max_prefill_context_len=0)


class PrefillKeySlotsMetadataBuilder(AttentionMetadataBuilder):
    metadata_cls = PrefillKeySlotsMetadata

    def build(self) -> PrefillKeySlotsMetadata:
        a = self.state.arrays()
        n = self.state.num_prefills
        slots = key_slots_for(a["block_tables"][:n], a["seq_lens"][:n], self.block_size)
        return self.metadata_cls(**self.state.common_fields(),
                                 prefill_key_slots=torch.from_numpy(slots),
                                 max_prefill_context_len=int(a["context_lens"][:n].max(initial=0)))
