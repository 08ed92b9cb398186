"""The plain data that crosses the worker boundary once per step.

`ExecuteModelRequest` goes from the engine to the driver worker (it holds sequence objects
and never leaves the driver). `WorkerInput` and `ModelInput` are what every rank needs;
they flatten into one dict of tensors and plain values for the per-step broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from omniinfer.attention.backend import AttentionMetadata
from omniinfer.engine.scheduler import ScheduledSeq
from omniinfer.sampling.metadata import SamplingMetadata


@dataclass(slots=True)
class ExecuteModelRequest:
    scheduled: list[ScheduledSeq]
    block_tables: dict[int, list[int]]  # seq_id -> device block ids
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    num_steps: int = 1  # decode steps to run back to back (every sequence a plain decode)


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).view(-1, 2)


@dataclass
class WorkerInput:
    """Cache operations to run before the forward pass (each [n, 2] int64 (src, dst))."""

    blocks_to_swap_in: torch.Tensor
    blocks_to_swap_out: torch.Tensor
    blocks_to_copy: torch.Tensor

    @classmethod
    def nothing(cls) -> WorkerInput:
        empty = _pairs([])
        return cls(empty, empty, empty)

    @classmethod
    def from_request(cls, request: ExecuteModelRequest) -> WorkerInput:
        return cls(_pairs(request.blocks_to_swap_in), _pairs(request.blocks_to_swap_out),
                   _pairs(request.blocks_to_copy))

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
