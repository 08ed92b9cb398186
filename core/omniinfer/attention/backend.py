"""The attention-backend contract: a descriptor, a metadata builder and an implementation.

* :class:`AttentionBackend` (descriptor): a name, what it supports, the KV-cache layout,
  and ``validate(spec)`` returning the reasons it cannot serve a configuration.
* :class:`AttentionMetadataBuilder`: one call, ``build(common)``, from the step's
  vendor-neutral :class:`~omniinfer.attention.common.CommonAttentionMetadata` (plain data:
  lengths, slots and block tables, never the runner) to the backend's :class:`AttentionMetadata`.
* :class:`AttentionImpl`: ``forward(query, key, value, kv_cache, metadata)`` for one layer.

Batch layout every backend shares: prefill sequences first, decode sequences after; a
"decode" is a sequence with exactly one new token and something already cached. All
tokens of the step are flattened into one dimension in that order.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any, ClassVar

import torch

from omniinfer.attention.common import CommonAttentionMetadata


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """What a backend needs to know to accept or refuse a configuration (plain data)."""

    device_type: str  # torch device type of the selected platform
    platform_name: str
    dtype: torch.dtype  # model / KV-cache dtype
    head_size: int
    num_heads: int  # query heads on one rank
    num_kv_heads: int  # KV heads on one rank
    block_size: int
    sliding_window: int | None = None  # the model's sliding layers' window (None: none slide)
    logits_soft_cap: float | None = None  # attention-score soft-capping some layers need (Gemma 2)
    device_capability: tuple[int, int] | None = None  # e.g. (9, 0) for an H100; None off-GPU
    min_triton_capability: tuple[int, int] | None = None  # the platform's floor for Triton kernels
    device_arch: str | None = None  # what device 0's code is compiled for: "sm_90", "gfx942"


class AttentionBackend:
    """Descriptor of one attention backend. Subclasses set the class attributes."""

    name: ClassVar[str] = ""
    supported_device_types: ClassVar[tuple[str, ...]] = ()
    # platforms it serves by name (None: every platform of its device types). ROCm's torch
    # answers to the "cuda" device type too, so a CUDA-only library says ("cuda",) here.
    supported_platforms: ClassVar[tuple[str, ...] | None] = None
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)
    supported_head_sizes: ClassVar[tuple[int, ...] | None] = None  # None: any
    supports_sliding_window: ClassVar[bool] = True
    # True when its metadata is made from `block_tables` and `slot_mapping` alone (nothing derived
    # from them at build time), so a sliding layer can read the window pool's through
    # `AttentionMetadata.for_window` (engine/kv_groups.py); otherwise every layer keeps all blocks
    supports_window_pool: ClassVar[bool] = False
    # True when the impl applies `logits_soft_cap` (cap * tanh(scores / cap) before the softmax)
    supports_logits_soft_cap: ClassVar[bool] = False
    # True when a decode-only step can be captured in a device graph and replayed: the write
    # path skips slot -1 (padding rows), and decode reads per-step data only from the metadata's
    # tensors (never from its host lists or max_* ints, which a replay does not refresh).
    supports_graph_capture: ClassVar[bool] = False

    @classmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        """Reasons this backend cannot serve `spec`; empty when it can."""
        reasons = []
        if spec.device_type not in cls.supported_device_types:
            reasons.append(f"runs on {'/'.join(cls.supported_device_types)}, not {spec.device_type}")
        if spec.dtype not in cls.supported_dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
            reasons.append(f"dtype {str(spec.dtype).removeprefix('torch.')} not supported (supports {allowed})")
        if cls.supported_head_sizes is not None and spec.head_size not in cls.supported_head_sizes:
            reasons.append(f"head size {spec.head_size} not supported "
                           f"(supports {', '.join(map(str, cls.supported_head_sizes))})")
        if spec.sliding_window and not cls.supports_sliding_window:
            reasons.append("sliding-window attention not supported")
        if spec.logits_soft_cap and not cls.supports_logits_soft_cap:
            reasons.append(f"attention logit soft-capping ({spec.logits_soft_cap}) not supported")
        if cls.supported_platforms is not None and spec.platform_name not in cls.supported_platforms:
            reasons.append(f"serves the {'/'.join(cls.supported_platforms)} platform only, not "
                           f"{spec.platform_name}")
        return reasons + cls.extra_reasons(spec)

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        """Backend-specific refusals (library missing, compute capability...)."""
        return []

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache. Default: [2 (key, value), blocks, block_size, kv heads, head]."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def allocate_kv_cache(cls, shape: tuple[int, ...], dtype: torch.dtype,
                          device: torch.device) -> torch.Tensor:
        """One layer's cache, zero-filled (padded reads of never-written slots must be finite).
        A backend may place it where its kernels read it fastest."""
        return torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        """The metadata builder; the default builds the common `AttentionMetadata`."""
        return AttentionMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        raise NotImplementedError

    @staticmethod
    def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                    src_to_dst: torch.Tensor) -> None:
        """Copy blocks between two caches of one layer (swap in/out); src_to_dst: [n, 2] int64."""
        if src_to_dst.numel() == 0:
            return
        src = src_to_dst[:, 0].to(src_cache.device)
        dst = src_to_dst[:, 1].to(dst_cache.device)
        dst_cache[:, dst] = src_cache[:, src].to(dst_cache.device)

    @staticmethod
    def copy_blocks(kv_caches: list[torch.Tensor], src_to_dst: torch.Tensor) -> None:
        """Copy-on-write inside each layer's cache; src_to_dst: [n, 2] int64 on the cache device."""
        if src_to_dst.numel() == 0:
            return
        src, dst = src_to_dst[:, 0], src_to_dst[:, 1]
        for cache in kv_caches:
            cache[:, dst] = cache[:, src]


@dataclass
class AttentionMetadata:
    """Per-step attention inputs shared by every backend (subclasses add their own fields).

    Tensors are built on the CPU and moved with :meth:`to`. Sequence order: prefills, then
    decodes. Token order: the same, flattened.
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot (block * block_size + offset) per token
    seq_lens: list[int]  # per sequence: tokens in the cache after this step (host copy)
    seq_lens_tensor: torch.Tensor  # [num_seqs] int32, same values
    query_lens: list[int]  # per sequence: new tokens this step (host copy)
    context_lens_tensor: torch.Tensor  # [num_seqs] int32: tokens already cached before this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query_lens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # the sliding layers' block table and slots where the model keeps its windows in a pool of
    # their own (engine/kv_groups.py); None otherwise. `for_window()` is their view.
    window_block_tables: torch.Tensor | None = field(default=None, kw_only=True)
    window_slot_mapping: torch.Tensor | None = field(default=None, kw_only=True)

    @cached_property
    def for_window(self) -> AttentionMetadata:
        """This step as a sliding-window layer sees it: the window pool's block table and slots
        (the metadata itself when the model has no window pool)."""
        if self.window_block_tables is None:
            return self
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(block_tables=self.window_block_tables, slot_mapping=self.window_slot_mapping,
                      window_block_tables=None, window_slot_mapping=None)
        return type(self)(**values)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    @cached_property
    def prefill_metadata(self) -> AttentionMetadata | None:
        """A view of the prefill part (None when the batch has no prefills; the metadata
        itself when it has nothing else)."""
        if self.num_prefills == 0:
            return None
        if self.num_decode_tokens == 0:
            return self
        return self._slice(0, self.num_prefills, 0, self.num_prefill_tokens)

    @cached_property
    def decode_metadata(self) -> AttentionMetadata | None:
        """A view of the decode part (None when the batch has no decodes; the metadata itself
        when it has nothing else, so a captured decode graph reads the very tensors a replay
        refreshes)."""
        if self.num_decode_tokens == 0:
            return None
        if self.num_prefills == 0:
            return self
        return self._slice(self.num_prefills, self.num_seqs, self.num_prefill_tokens,
                           self.num_prefill_tokens + self.num_decode_tokens)

    def slice_fields(self, s0: int, s1: int, t0: int, t1: int) -> dict[str, Any]:
        """Subclass fields for the part of sequences [s0, s1) and tokens [t0, t1).

        A subclass that adds per-sequence or per-token fields overrides this (calling super());
        fields it does not return are copied unchanged into both parts.
        """
        return {}

    def _slice(self, s0: int, s1: int, t0: int, t1: int) -> AttentionMetadata:
        qsl = self.query_start_loc[s0:s1 + 1]
        query_lens = self.query_lens[s0:s1]
        seq_lens = self.seq_lens[s0:s1]
        changes = dict(
            num_prefills=self.num_prefills if s0 == 0 else 0,
            num_prefill_tokens=self.num_prefill_tokens if s0 == 0 else 0,
            num_decode_tokens=0 if s0 == 0 else self.num_decode_tokens,
            slot_mapping=self.slot_mapping[t0:t1],
            seq_lens=seq_lens,
            seq_lens_tensor=self.seq_lens_tensor[s0:s1],
            query_lens=query_lens,
            context_lens_tensor=self.context_lens_tensor[s0:s1],
            query_start_loc=qsl - qsl[0],
            block_tables=self.block_tables[s0:s1],
            window_block_tables=None if self.window_block_tables is None else self.window_block_tables[s0:s1],
            window_slot_mapping=None if self.window_slot_mapping is None else self.window_slot_mapping[t0:t1],
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        values.update(self.slice_fields(s0, s1, t0, t1))
        return type(self)(**values)

    # ---- moving and broadcasting ------------------------------------------------------------
    def to(self, device: torch.device | str) -> AttentionMetadata:
        values = {}
        for f in fields(self):
            v = getattr(self, f.name)
            values[f.name] = v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        return type(self)(**values)

    def as_dict(self) -> dict[str, Any]:
        """Flat dict of tensors and plain values (for `broadcast_tensor_dict`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> AttentionMetadata:
        return cls(**values)


class AttentionMetadataBuilder:
    """Turns the step's :class:`~omniinfer.attention.common.CommonAttentionMetadata` into this
    backend's metadata, in one call: the whole contract of a builder (plugin API 2).

    The default builds the common :class:`AttentionMetadata`. A backend whose kernels need more
    subclasses it, sets `metadata_cls`, and computes its extra fields from `common` with torch
    ops (they run on the CPU for a new step, and on the device when multi-step decoding or a
    draft model advances `common`, so they must not copy to the host). Set
    `needs_prefill_key_slots` to get `common.prefill_key_slots` filled in.
    """

    metadata_cls: ClassVar[type[AttentionMetadata]] = AttentionMetadata
    needs_prefill_key_slots: ClassVar[bool] = False

    def __init__(self, block_size: int, sliding_window: int | None = None):
        self.block_size = block_size
        self.sliding_window = sliding_window

    def build(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        return self.metadata_cls(**common_fields(common))


def common_fields(common: CommonAttentionMetadata) -> dict[str, Any]:
    """The fields of :class:`AttentionMetadata`, from the common description."""
    return dict(
        num_prefills=common.num_prefills, num_prefill_tokens=common.num_prefill_tokens,
        num_decode_tokens=common.num_decode_tokens, slot_mapping=common.slot_mapping,
        seq_lens=common.seq_lens_host, seq_lens_tensor=common.seq_lens,
        query_lens=common.query_lens_host, context_lens_tensor=common.context_lens,
        query_start_loc=common.query_start_loc, block_tables=common.block_table,
        max_query_len=common.max_query_len, max_seq_len=common.max_seq_len,
        window_block_tables=common.window_block_table, window_slot_mapping=common.window_slot_mapping)


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


class PrefillKeySlotsMetadataBuilder(AttentionMetadataBuilder):
    metadata_cls = PrefillKeySlotsMetadata
    needs_prefill_key_slots = True

    def build(self, common: CommonAttentionMetadata) -> PrefillKeySlotsMetadata:
        return self.metadata_cls(**common_fields(common), prefill_key_slots=common.prefill_key_slots,
                                 max_prefill_context_len=common.max_prefill_context_len)


class AttentionImpl:
    """One layer's attention computation for a backend."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """query [T, num_heads * head], key/value [T, num_kv_heads * head] -> [T, num_heads * head].

        Writes this step's keys and values into `kv_cache` at `metadata.slot_mapping` first,
        then attends over everything cached for each sequence (causal within the step).
        """
        raise NotImplementedError


class StagedAttentionImpl(AttentionImpl):
    """The shape most backends share: write the step's keys and values into the cache, then
    run the prefill part and the decode part with their own kernels, each filling its rows of
    the output. Subclasses implement the three primitives."""

    def forward(self, query, key, value, kv_cache, metadata):
        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        self.write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        n = metadata.num_prefill_tokens
        if (prefill := metadata.prefill_metadata) is not None:
            self.prefill(out[:n], q[:n], k[:n], v[:n], kv_cache, prefill)
        if (decode := metadata.decode_metadata) is not None:
            self.decode(out[n:], q[n:], kv_cache, decode)
        return out.view(num_tokens, self.num_heads * self.head_size)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Store key/value [T, kv_heads, head] at their slots."""
        raise NotImplementedError

    def prefill(self, out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Fill `out` [prefill tokens, heads, head] (key/value are this step's, also cached)."""
        raise NotImplementedError

    def decode(self, out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
               metadata: AttentionMetadata) -> None:
        """Fill `out` [decode tokens, heads, head] from the cache."""
        raise NotImplementedError

