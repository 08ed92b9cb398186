"""The control plane: one dict of tensors and plain values from the driver to every rank.

Metadata (keys, and for each tensor its dtype and shape; plain values as they are) goes in
one object broadcast; the tensors follow as asynchronous broadcasts that are all waited on.
Everything travels on the CPU over the control group (gloo, whatever the vendor), so the
driver never copies a step's inputs to a device just to send them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]


class BroadcastStats:
    """Counts for tests and the control-plane benchmark."""

    num_broadcasts = 0
    num_bytes = 0

    @classmethod
    def reset(cls) -> None:
        cls.num_broadcasts = 0
        cls.num_bytes = 0


_control_group = None


def set_control_group(group) -> None:
    global _control_group
    _control_group = group


def control_group():
    return _control_group


def broadcast_tensor_dict(tensor_dict: dict[str, Any] | None = None, src: int = 0,
                          group=None) -> dict[str, Any] | None:
    """On `src`, send `tensor_dict`; elsewhere, return the dict received."""
    if not dist.is_initialized() or dist.get_world_size(group or _control_group) == 1:
        return tensor_dict
    group = group or _control_group
    BroadcastStats.num_broadcasts += 1
    if dist.get_rank() == src:
        metadata, tensors = [], []
        for key, value in tensor_dict.items():
            if isinstance(value, torch.Tensor):
                tensor = value.detach().to("cpu").contiguous()
                metadata.append((key, TensorMeta(tensor.dtype, tuple(tensor.shape))))
                tensors.append(tensor)
                BroadcastStats.num_bytes += tensor.numel() * tensor.element_size()
            else:
                metadata.append((key, value))
        dist.broadcast_object_list([metadata], src=src, group=group)
        handles = [dist.broadcast(t, src=src, group=group, async_op=True)
                   for t in tensors if t.numel()]
        for h in handles:
            h.wait()
        return tensor_dict
    box = [None]
    dist.broadcast_object_list(box, src=src, group=group)
    out, handles = {}, []
    for key, value in box[0]:
        if isinstance(value, TensorMeta):
            tensor = torch.empty(value.shape, dtype=value.dtype)
            if tensor.numel():
                handles.append(dist.broadcast(tensor, src=src, group=group, async_op=True))
            out[key] = tensor
        else:
            out[key] = value
    for h in handles:
        h.wait()
    return out
