"""What every rank needs for one step, built by the driver from the scheduler's plain data
(`SchedulerOutput`, omniinfer/step.py): `WorkerInput` (cache operations) and `ModelInput`
(tokens, positions, the backend's metadata). They flatten into one dict of tensors and plain
values for the per-step broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from omniinfer.attention.backend import AttentionMetadata
from omniinfer.attention.common import CommonAttentionMetadata
from omniinfer.sampling.metadata import SamplingMetadata
from omniinfer.step import SchedulerOutput


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)


@dataclass
class WorkerInput:
    """Cache operations to run before the forward pass (each [n, 2] int64 (src, dst))."""

    blocks_to_swap_in: torch.Tensor
    blocks_to_swap_out: torch.Tensor
    blocks_to_copy: torch.Tensor
    # copy-on-writes in the sliding layers' pool (engine/kv_groups.py)
    window_blocks_to_copy: torch.Tensor = field(default_factory=lambda: _pairs([]))

    @classmethod
    def nothing(cls) -> WorkerInput:
        empty = _pairs([])
        return cls(empty, empty, empty, empty)

    @classmethod
    def from_schedule(cls, sched: SchedulerOutput) -> WorkerInput:
        return cls(_pairs(sched.blocks_to_swap_in), _pairs(sched.blocks_to_swap_out),
                   _pairs(sched.blocks_to_copy), _pairs(sched.window_blocks_to_copy))

    def as_broadcastable_tensor_dict(self) -> dict[str, Any]:
        return {f"worker.{f.name}": getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_broadcasted_tensor_dict(cls, values: dict[str, Any]) -> WorkerInput:
        return cls(**{f.name: values[f"worker.{f.name}"] for f in fields(cls)})


@dataclass
class ModelInput:
    """One step's model inputs; all tensors on the CPU until `to(device)`."""

    input_tokens: torch.Tensor  # [num_tokens] int64
    input_positions: torch.Tensor  # [num_tokens] int64
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logit_rows] int64: token rows that need logits
    sampling_metadata: SamplingMetadata | None = None  # driver only; never broadcast
    common: CommonAttentionMetadata | None = None  # driver only: what attn_metadata was built from

    @property
    def num_tokens(self) -> int:
        return self.input_tokens.shape[0]

    def to(self, device: torch.device | str) -> ModelInput:
        return ModelInput(
            input_tokens=self.input_tokens.to(device, non_blocking=True),
            input_positions=self.input_positions.to(device, non_blocking=True),
            attn_metadata=self.attn_metadata.to(device),
            logits_indices=self.logits_indices.to(device, non_blocking=True),
            sampling_metadata=self.sampling_metadata,
            common=self.common,
        )

    def as_broadcastable_tensor_dict(self) -> dict[str, Any]:
        out = {
            "input_tokens": self.input_tokens,
            "input_positions": self.input_positions,
            "logits_indices": self.logits_indices,
        }
        out.update({f"attn.{k}": v for k, v in self.attn_metadata.as_dict().items()})
        return out

    @classmethod
    def from_broadcasted_tensor_dict(cls, values: dict[str, Any],
                                     metadata_cls: type[AttentionMetadata]) -> ModelInput:
        attn = {k[len("attn."):]: v for k, v in values.items() if k.startswith("attn.")}
        return cls(
            input_tokens=values["input_tokens"],
            input_positions=values["input_positions"],
            attn_metadata=metadata_cls.from_dict(attn),
            logits_indices=values["logits_indices"],
        )
