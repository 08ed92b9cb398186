"""Which rank am I, in which tensor- and pipeline-parallel group.

With one process nothing is initialised and every query answers rank 0 of size 1, so the
model layers are written once for any parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class ParallelGroups:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: object | None = None  # torch ProcessGroup
    pp_group: object | None = None
    tp_ranks: tuple[int, ...] = (0,)
    pp_ranks: tuple[int, ...] = (0,)


_STATE = ParallelGroups()


def state() -> ParallelGroups:
    return _STATE


def initialize_model_parallel(tp_size: int, pp_size: int, backend: str | None = None) -> None:
    """Split the default group (world = tp * pp) into TP and PP groups; rank = pp_rank * tp + tp_rank."""
    global _STATE
    world = dist.get_world_size()
    rank = dist.get_rank()
    if world != tp_size * pp_size:
        raise ValueError(f"world size {world} != tensor_parallel_size {tp_size} x "
                         f"pipeline_parallel_size {pp_size}")
    new = ParallelGroups(tp_size=tp_size, pp_size=pp_size, tp_rank=rank % tp_size,
                         pp_rank=rank // tp_size)
    for p in range(pp_size):  # every rank must create every group, in the same order
        ranks = tuple(range(p * tp_size, (p + 1) * tp_size))
        group = dist.new_group(list(ranks), backend=backend)
        if rank in ranks:
            new.tp_group, new.tp_ranks = group, ranks
    for t in range(tp_size):
        ranks = tuple(range(t, world, tp_size))
        group = dist.new_group(list(ranks), backend=backend)
        if rank in ranks:
            new.pp_group, new.pp_ranks = group, ranks
    _STATE = new


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = ParallelGroups()


def get_tp_size() -> int:
    return _STATE.tp_size


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_pp_size() -> int:
    return _STATE.pp_size


def get_pp_rank() -> int:
    return _STATE.pp_rank


def is_first_pp_rank() -> bool:
    return _STATE.pp_rank == 0


def is_last_pp_rank() -> bool:
    return _STATE.pp_rank == _STATE.pp_size - 1


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.tp_group)
    return torch.cat(parts, dim=dim)


def layer_range(num_layers: int) -> tuple[int, int]:
    """[start, end) of the decoder layers this pipeline stage holds (earlier stages take the remainder)."""
    size, rank = _STATE.pp_size, _STATE.pp_rank
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
