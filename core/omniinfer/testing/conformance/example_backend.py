"""EXAMPLE: the whole of an attention backend, as a vendor writes one (plugin API 2).

Three small classes, each one role: the descriptor says what it serves and why not; the metadata
builder turns the step's `CommonAttentionMetadata` into its own metadata in one call; the impl
writes the step's keys and values, then attends. The kernels here are plain torch (the reference's
arithmetic), and the extra metadata field is the kind a varlen kernel reads: where each
sequence's keys start. The kit runs its own checks on this backend in every suite
(test_example_backend.py); it is never registered, so no platform selects it.

A plugin registers its backends from its hook module::

    @hookimpl
    def omniinfer_attention_backends():
        from omniinfer_acme.attention import AcmeBackend
        return [AcmeBackend]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from omniinfer.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionSpec,
    StagedAttentionImpl,
    common_fields,
)
from omniinfer.attention.common import CommonAttentionMetadata
from omniinfer.attention.ops import causal_mask, gather_kv, write_to_kv_cache


@dataclass
class ExampleMetadata(AttentionMetadata):
    """The common fields, plus what this backend's kernels read."""

    cu_seqlens_k: torch.Tensor  # [num_seqs + 1] int32: where each sequence's keys start

    def slice_fields(self, s0: int, s1: int, t0: int, t1: int) -> dict:
        cu = self.cu_seqlens_k[s0:s1 + 1]  # (the prefill and decode views rebase it)
        return dict(cu_seqlens_k=cu - cu[0])


class ExampleMetadataBuilder(AttentionMetadataBuilder):
    """One call, torch ops only: it also runs on the device, on a batch advanced for drafting."""

    metadata_cls = ExampleMetadata

    def build(self, common: CommonAttentionMetadata) -> ExampleMetadata:
        cu_seqlens_k = F.pad(common.seq_lens.cumsum(0), (1, 0)).to(torch.int32)
        return ExampleMetadata(**common_fields(common), cu_seqlens_k=cu_seqlens_k)


class ExampleImpl(StagedAttentionImpl):
    def write_kv(self, key, value, kv_cache, slot_mapping):
        write_to_kv_cache(key, value, kv_cache, slot_mapping)  # slot -1 would be a kernel's to skip

    def prefill(self, out, query, key, value, kv_cache, metadata):
        self._attend(out, query, kv_cache, metadata)

    def decode(self, out, query, kv_cache, metadata):
        self._attend(out, query, kv_cache, metadata)

    def _attend(self, out, query, kv_cache, md: ExampleMetadata) -> None:
        qsl, cu_k = md.query_start_loc.tolist(), md.cu_seqlens_k.tolist()
        group = self.num_heads // self.num_kv_heads
        for i in range(md.num_seqs):
            q0, q1, seq_len = qsl[i], qsl[i + 1], cu_k[i + 1] - cu_k[i]
            k, v = gather_kv(kv_cache, md.block_tables[i], seq_len)
            k = k.float().repeat_interleave(group, dim=1)
            v = v.float().repeat_interleave(group, dim=1)
            scores = torch.einsum("qhd,khd->hqk", query[q0:q1].float(), k) * self.scale
            mask = causal_mask(seq_len - (q1 - q0), q1 - q0, seq_len, self.sliding_window, query.device)
            probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)


class ExampleBackend(AttentionBackend):
    name: ClassVar[str] = "EXAMPLE"
    supported_device_types: ClassVar[tuple[str, ...]] = ("cpu", "cuda", "xpu")
    supported_platforms: ClassVar[tuple[str, ...] | None] = None  # any platform of those types
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.bfloat16, torch.float16)

    @classmethod
    def extra_reasons(cls, spec: AttentionSpec) -> list[str]:
        """What validate() does not already check: a library missing, a device too old..."""
        return [f"head size {spec.head_size} > 256"] if spec.head_size > 256 else []

    @classmethod
    def get_builder_cls(cls) -> type[ExampleMetadataBuilder]:
        return ExampleMetadataBuilder

    @classmethod
    def get_impl_cls(cls) -> type[ExampleImpl]:
        return ExampleImpl
