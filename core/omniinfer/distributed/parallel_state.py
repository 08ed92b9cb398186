"""Which rank am I, in which tensor- and pipeline-parallel group; the data-plane collectives.

With one process nothing is initialised and every query answers rank 0 of size 1, so the
model layers are written once for any parallel size.

Ranks: rank = pp_rank * tp_size + tp_rank, so rank 0 (the driver) is the first stage's TP
rank 0 and each pipeline stage is a contiguous block of TP ranks. Three kinds of groups:

* the default group (the platform's backend: gloo, nccl, xccl...) and the TP groups and PP
  pairs split from it carry the data plane: all-reduces, all-gathers, and the stage-to-stage
  tensors, each a broadcast in the 2-rank group of the sender and the receiver (a collective,
  so waits.py can abandon its wait; a gloo send/recv cannot be waited for in slices);
* the control group (always gloo, CPU tensors) carries the driver's per-step broadcast
  (see communication.py). Its timeout is effectively infinite because the other ranks wait
  in it for the next step however long the engine sits idle; a dead peer is noticed anyway
  (gloo fails a pending operation as soon as the peer's socket closes).

Collectives on gloo groups are waited for through waits.py, so the executor can end a wait
that a dead peer's socket did not (`waits.abandon`). Destroying a group waits for the operations
in its threads, and gloo does not fail an operation whose peer died in the middle of a message
(it waits out its timeout), so after an abandon the groups are destroyed on a thread of their
own: shutdown waits RELEASE_WAIT_S for it, and if it is still stuck the process cannot start
another distributed engine until the stuck operation times out (`OMNIINFER_DIST_TIMEOUT_S`).
"""

from __future__ import annotations

import math
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from omniinfer.distributed import waits
from omniinfer.distributed.communication import set_control_group
from omniinfer.logger import init_logger

logger = init_logger(__name__)

ENV_TIMEOUT = "OMNIINFER_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0  # a backstop: dead workers are detected by the executor in seconds
CONTROL_TIMEOUT = timedelta(days=3650)
RELEASE_WAIT_S = 5.0  # how long shutdown waits for abandoned groups to be destroyed

_release: threading.Thread | None = None  # destroying abandoned groups (see the top)
_release_deadline = 0.0  # when their stuck operations time out at the latest


@dataclass(slots=True)
class ParallelGroups:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: object | None = None  # torch ProcessGroup
    tp_ranks: tuple[int, ...] = (0,)  # global ranks of my TP group
    pp_ranks: tuple[int, ...] = (0,)  # global ranks of my TP peers in each stage, by stage
    # stage -> a 2-rank group of me and my TP peer in that stage, for the stages I exchange
    # tensors with (the next one, and the last and first, which send the logits back)
    pp_pairs: dict[int, object] = field(default_factory=dict)


_STATE = ParallelGroups()


def state() -> ParallelGroups:
    return _STATE


def data_plane_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get(ENV_TIMEOUT) or DEFAULT_TIMEOUT_S))


def init_distributed_environment(rank: int, world_size: int, init_method: str,
                                 backend: str) -> None:
    """Join the default group (data plane, `backend`) and create the gloo control group."""
    if dist.is_initialized():
        raise RuntimeError(pending_release() or (
            "torch.distributed is already initialised in this process: one distributed engine "
            "per process; shut the other one down first"))
    waits.reset()  # an earlier engine's abandon
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=data_plane_timeout())
    try:
        set_control_group(dist.new_group(list(range(world_size)), backend="gloo",
                                         timeout=CONTROL_TIMEOUT))
    except BaseException:
        dist.destroy_process_group()
        raise


def destroy_distributed_environment() -> None:
    global _release, _release_deadline
    set_control_group(None)
    destroy_model_parallel()
    if not dist.is_initialized():
        return
    if not waits.is_abandoned():
        dist.destroy_process_group()
        return
    _release_deadline = time.monotonic() + data_plane_timeout().total_seconds()
    _release = threading.Thread(target=dist.destroy_process_group, name="omniinfer-release-groups",
                                daemon=True)
    _release.start()
    _release.join(RELEASE_WAIT_S)
    if _release.is_alive():
        logger.warning("%s", pending_release())


def wait_for_release(timeout_s: float) -> None:
    """Wait up to `timeout_s` for abandoned groups to be destroyed, if they are being destroyed."""
    if _release is not None:
        _release.join(timeout_s)


def pending_release() -> str | None:
    """Why this process's process groups are not destroyed yet, if they are being destroyed."""
    if _release is None or not _release.is_alive():
        return None
    left = max(0.0, _release_deadline - time.monotonic())
    return (f"the process groups of an engine that failed are still being destroyed: a collective "
            f"given up on after a rank died is still held by gloo (a peer that dies in the middle "
            f"of a message leaves the receiving operation to wait out its timeout, "
            f"{ENV_TIMEOUT}={data_plane_timeout().total_seconds():.0f} s); this process can start "
            f"another distributed engine in about {left:.0f} s, or start it in a new process")


def initialize_model_parallel(tp_size: int, pp_size: int, backend: str | None = None) -> None:
    """Split the default group (world = tp * pp) into TP groups and PP pairs; rank = pp_rank * tp + tp_rank."""
    global _STATE
    world = dist.get_world_size()
    rank = dist.get_rank()
    if world != tp_size * pp_size:
        raise ValueError(f"world size {world} != tensor_parallel_size {tp_size} x "
                         f"pipeline_parallel_size {pp_size}")
    new = ParallelGroups(tp_size=tp_size, pp_size=pp_size, tp_rank=rank % tp_size,
                         pp_rank=rank // tp_size)
    timeout = data_plane_timeout()
    for p in range(pp_size):  # every rank must create every group, in the same order
        ranks = tuple(range(p * tp_size, (p + 1) * tp_size))
        group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
        if rank in ranks:
            new.tp_group, new.tp_ranks = group, ranks
    new.pp_ranks = tuple(range(new.tp_rank, world, tp_size))
    # stage-to-stage tensors go as broadcasts in 2-rank groups, not as send/recv: a broadcast
    # is a collective, so its wait can be abandoned in slices (waits.py), where a gloo
    # send/recv whose wait times out closes its pair
    pairs = (sorted({tuple(sorted((p, (p + 1) % pp_size))) for p in range(pp_size)})
             if pp_size > 1 else [])
    for t in range(tp_size):
        for a, b in pairs:
            ranks = (a * tp_size + t, b * tp_size + t)
            group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
            if rank in ranks:
                new.pp_pairs[b if rank == ranks[0] else a] = group
    _STATE = new


@contextmanager
def single_rank():
    """Build or run a model as if this process were alone (rank 0 of 1), whatever the
    engine's layout: the speculative draft lives on the driver only."""
    global _STATE
    saved, _STATE = _STATE, ParallelGroups()
    try:
        yield
    finally:
        _STATE = saved


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
    waits.run(dist.all_reduce, x, group=_STATE.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _STATE.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    waits.run(dist.all_gather, parts, x.contiguous(), group=_STATE.tp_group)
    return torch.cat(parts, dim=dim)


def pp_send(tensors: list[torch.Tensor], stage: int) -> None:
    """Send tensors of one dtype to my TP peer in pipeline stage `stage` (shapes are known to
    the receiver): as one broadcast in our 2-rank group, several tensors packed into one (a
    gloo broadcast of 896 floats costs ~0.1 ms more than a send: benchmarks/collective_waits.py
    --op stage)."""
    flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].contiguous()
    if flat.numel():
        waits.run(dist.broadcast, flat, src=_STATE.pp_ranks[_STATE.pp_rank],
                  group=_STATE.pp_pairs[stage])


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device,
            stage: int) -> list[torch.Tensor]:
    """Receive what `pp_send` sent from my TP peer in pipeline stage `stage`."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = torch.empty(sum(sizes), dtype=dtype, device=device)
    if flat.numel():
        waits.run(dist.broadcast, flat, src=_STATE.pp_ranks[stage], group=_STATE.pp_pairs[stage])
    return [part.view(shape) for part, shape in zip(flat.split(sizes), shapes, strict=True)]


def layer_range(num_layers: int) -> tuple[int, int]:
    """[start, end) of the decoder layers this pipeline stage holds (earlier stages take the remainder)."""
    size, rank = _STATE.pp_size, _STATE.pp_rank
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
