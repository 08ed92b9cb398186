"""The process heap, after loading: glibc keeps the pages the loader's transient buffers freed
(the tokenizer's conversion, a GGUF file's copied blocks before a kernel repacks them, ~30-60
MB for a 152k-token vocabulary), and malloc_trim gives the free ones back to the system."""

from __future__ import annotations

import contextlib


def release_freed_memory() -> None:
    """Give the heap's free pages back. (No gc.collect() here: a SIGTERM whose handler raises
    inside a finalizer that collection runs is swallowed, and the benchmarks unwind on SIGTERM.)"""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # (not glibc: nothing to do)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
