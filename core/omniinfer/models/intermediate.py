from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: {"hidden_states": [T, H], "residual": [T, H]}."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def to(self, device) -> IntermediateTensors:
        return IntermediateTensors({k: v.to(device) for k, v in self.tensors.items()})
