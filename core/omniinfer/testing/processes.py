"""Checks that a test left no process behind (Linux: reads /proc)."""

from __future__ import annotations

import os
import time


def child_pids(pid: int | None = None) -> set[int]:
    """Live (or unreaped) child processes of `pid` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.add(int(entry))
    return found


def is_alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_no_child_processes(timeout_s: float = 5.0, ignore: set[int] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := child_pids() - (ignore or set())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {sorted(left)}"


def wait_until_gone(pids, timeout_s: float = 10.0) -> list[int]:
    """The pids still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if is_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive
