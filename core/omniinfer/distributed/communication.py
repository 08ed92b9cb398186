"""The control plane: one dict of tensors and plain values from the driver to every rank.

The dict travels as ONE byte buffer on the control group (gloo, CPU, whatever the vendor):

    [total bytes: int64][metadata bytes: int64][pickled metadata][tensor bytes, 16-aligned]

The metadata holds the keys, the plain values as they are, and for each tensor its dtype,
shape and offset. The first broadcast always carries the first `FIRST_BROADCAST_BYTES` of
the buffer (a decode step of 256 sequences fits), so a typical step costs one collective;
a larger step sends the rest in a second one. Receivers rebuild the tensors as views of the
buffer; every rank then moves them to its device itself, so the driver never copies a
step's inputs to a device just to send them.

(A metadata broadcast followed by one broadcast per tensor, the obvious layout, costs a
collective round trip per tensor: ~12 per step. benchmarks/control_plane.py measures both.)
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from omniinfer.distributed import waits

FIRST_BROADCAST_BYTES = 1 << 16
_ALIGN = 16
_HEADER = 16  # two int64: total bytes, metadata bytes


@dataclass(frozen=True, slots=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the buffer


class BroadcastStats:
    """Counts of this process's broadcasts (for tests and the control-plane benchmark)."""

    num_broadcasts = 0  # broadcast_tensor_dict calls (collectives: 1, or 2 for large dicts)
    num_bytes = 0  # payload: header, pickled metadata and tensor bytes
    num_tensor_bytes = 0
    time_s = 0.0  # wall time inside broadcast_tensor_dict

    @classmethod
    def reset(cls) -> None:
        cls.num_broadcasts = 0
        cls.num_bytes = 0
        cls.num_tensor_bytes = 0
        cls.time_s = 0.0


_control_group = None


def set_control_group(group) -> None:
    global _control_group
    _control_group = group


def control_group():
    return _control_group


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack(tensor_dict: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """The dict as one uint8 buffer (at least FIRST_BROADCAST_BYTES long) and its length."""
    metadata, tensors, offset = [], [], 0
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            tensor = value.detach().to("cpu").contiguous()
            metadata.append((key, TensorMeta(tensor.dtype, tuple(tensor.shape), offset)))
            tensors.append((offset, tensor))
            offset += _align(tensor.numel() * tensor.element_size())
        else:
            metadata.append((key, value))
    header = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    start = _align(_HEADER + len(header))
    total = start + offset
    buffer = torch.empty(max(total, FIRST_BROADCAST_BYTES), dtype=torch.uint8)
    buffer[:_HEADER].view(torch.int64).copy_(torch.tensor([total, len(header)]))
    buffer[_HEADER:_HEADER + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    for at, tensor in tensors:
        if tensor.numel() == 0:  # (nothing to copy; numpy's empty arrays come with stride 0,
            continue  # which no byte view takes: a lone prompt's chunk with no logits rows)
        raw = tensor.reshape(-1).view(torch.uint8)
        buffer[start + at:start + at + raw.numel()] = raw
    return buffer, total


def unpack(buffer: torch.Tensor) -> dict[str, Any]:
    """The dict `pack` made; tensors are views of `buffer`."""
    total, header_bytes = buffer[:_HEADER].view(torch.int64).tolist()
    metadata = pickle.loads(buffer[_HEADER:_HEADER + header_bytes].numpy().tobytes())
    start = _align(_HEADER + header_bytes)
    out = {}
    for key, value in metadata:
        if isinstance(value, TensorMeta):
            count = 1
            for size in value.shape:
                count *= size
            nbytes = count * torch.empty((), dtype=value.dtype).element_size()
            raw = buffer[start + value.offset:start + value.offset + nbytes]
            value = raw.view(value.dtype).view(value.shape)
        out[key] = value
    return out


def broadcast_tensor_dict(tensor_dict: dict[str, Any] | None = None, src: int = 0,
                          group=None) -> dict[str, Any] | None:
    """On `src`, send `tensor_dict`; elsewhere, return the dict received (tensors on the CPU).

    With no distributed group (one rank) it returns `tensor_dict` and sends nothing."""
    group = group or _control_group
    if not dist.is_initialized() or group is None or dist.get_world_size(group) == 1:
        return tensor_dict
    start = time.perf_counter()
    BroadcastStats.num_broadcasts += 1
    first = FIRST_BROADCAST_BYTES
    if dist.get_rank() == src:
        buffer, total = pack(tensor_dict)
        waits.run(dist.broadcast, buffer[:first], src=src, group=group)
        if total > first:
            waits.run(dist.broadcast, buffer[first:total], src=src, group=group)
        BroadcastStats.num_bytes += total
        BroadcastStats.num_tensor_bytes += sum(v.numel() * v.element_size()
                                               for v in tensor_dict.values()
                                               if isinstance(v, torch.Tensor))
        BroadcastStats.time_s += time.perf_counter() - start
        return tensor_dict
    buffer = torch.empty(first, dtype=torch.uint8)
    waits.run(dist.broadcast, buffer, src=src, group=group)
    total = int(buffer[:8].view(torch.int64).item())
    if total > first:
        buffer = torch.cat([buffer, torch.empty(total - first, dtype=torch.uint8)])
        waits.run(dist.broadcast, buffer[first:], src=src, group=group)
    BroadcastStats.time_s += time.perf_counter() - start
    return unpack(buffer)
