"""The body of one `mp` worker process: `python -m omniinfer.executor.worker_process FD`.

FD is this end of a socket pair to the driver. Messages from the driver: the WorkerSpec,
then ("call", method, args, kwargs) for start-up and ("loop",) to enter the execution loop.
Messages to the driver: ("ready", pid), ("result", value), ("error", "Type: message +
traceback"), ("stopped", None). The process exits after an error, after its loop ends, and
as soon as the driver's end of the pipe closes (the engine's process died).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection


@dataclass(slots=True)
class WorkerSpec:
    rank: int
    local_rank: int
    config: object  # EngineConfig
    platform: type
    attn_backend: type
    distributed_init_method: str


def _format_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{''.join(traceback.format_exception(e)).rstrip()}"


def _exit_when_driver_closes(conn: Connection) -> None:
    """After start-up the driver sends nothing more: the end of its stream means it is gone."""
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def _send(conn: Connection, message) -> None:
    try:
        conn.send(message)
    except OSError:
        os._exit(1)


def main(fd: int) -> None:
    conn = Connection(fd)
    try:
        spec: WorkerSpec = conn.recv()
    except (EOFError, OSError):
        os._exit(1)
    try:
        from omniinfer.executor.base import resolve_worker_cls

        worker = resolve_worker_cls(spec.config)(
            spec.config, spec.platform, spec.attn_backend, rank=spec.rank,
            local_rank=spec.local_rank, is_driver=False,
            distributed_init_method=spec.distributed_init_method)
    except BaseException as e:
        _send(conn, ("error", _format_error(e)))
        os._exit(1)
    _send(conn, ("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            os._exit(1)
        try:
            if message[0] == "call":
                _, method, args, kwargs = message
                _send(conn, ("result", getattr(worker, method)(*args, **kwargs)))
                continue
            _send(conn, ("result", None))
            threading.Thread(target=_exit_when_driver_closes, args=(conn,), daemon=True).start()
            worker.start_worker_execution_loop()
        except BaseException as e:
            _send(conn, ("error", _format_error(e)))
            sys.stderr.flush()
            os._exit(1)
        _send(conn, ("stopped", None))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
