"""Waiting for a collective in a way the executor can end.

gloo fails a pending operation once a peer's socket closes, and that is how a rank blocked in a
collective usually learns that a peer died. It is not enough on its own: gloo does not fail the
operation that was reading a message when the peer died (it signals the buffers it has queued,
not the one it is reading into), and a socket outlives its process while anything else holds it
(a child the worker forked). The rank would then wait for its process group's timeout (ten
minutes for the data plane).

So collectives on gloo groups start asynchronously and are waited for in slices of `POLL`;
between slices the wait looks whether this process has given up on its collectives
(`abandon`, which the executor calls once it recorded a failed rank or shuts down) and if so
raises `CollectiveAbandoned`. Other backends (NCCL and friends) are called as they are: their
`wait()` orders streams rather than blocking the host, and they have watchdogs of their own.

Only collectives: a gloo send or recv (`isend`/`irecv`) closes its pair when a wait on it times
out, and its `is_completed()` does not turn true until it is waited for, so it cannot be waited
for in slices. The pipeline's stage-to-stage tensors therefore go as broadcasts in 2-rank
groups (parallel_state.pp_send).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

POLL = timedelta(seconds=0.2)

_abandoned: str | None = None


class CollectiveAbandoned(RuntimeError):
    """A collective given up on because the engine failed or stopped."""


def abandon(reason: str) -> None:
    """Make every pending and later wait of this process raise CollectiveAbandoned(reason)."""
    global _abandoned
    if _abandoned is None:
        _abandoned = reason


def is_abandoned() -> bool:
    return _abandoned is not None


def reset() -> None:
    """Forget `abandon` (a new engine is joining its process groups)."""
    global _abandoned
    _abandoned = None


def _raise_if_abandoned() -> None:
    if _abandoned is not None:
        raise CollectiveAbandoned(f"collective abandoned: {_abandoned}")


def _wait_in_slices(work) -> None:
    """`work.wait()`, in slices of POLL, raising CollectiveAbandoned once the process gave up."""
    while True:
        try:
            work.wait(POLL)
            return
        except RuntimeError:
            if work.is_completed():
                break  # it failed (or finished right after the slice ran out): the plain wait says which
            _raise_if_abandoned()
    work.wait()


def is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def run(op, *args, group, **kwargs) -> None:
    """`op(*args, group=group, **kwargs)` for a torch.distributed collective `op`, waited for
    in slices on gloo groups."""
    _raise_if_abandoned()
    if not is_gloo(group):
        op(*args, group=group, **kwargs)
        return
    _wait_in_slices(op(*args, group=group, async_op=True, **kwargs))
