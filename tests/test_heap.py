"""The heap after loading and when the engine goes idle: the pages freed buffers leave in glibc's
free lists go back to the system."""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest

from omniinfer import LLM, SamplingParams
from omniinfer.benchmarks.resident import anonymous_bytes
from omniinfer.heap import release_freed_memory

MB = 1 << 20


def glibc():
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip(f"needs glibc's malloc_trim (this is {platform.system()} {platform.libc_ver()})")
    return ctypes.CDLL("libc.so.6")


def test_freed_heap_pages_go_back_to_the_system():
    libc = glibc()
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(64 << 10) for _ in range(640)]  # 40 MB below the mmap threshold: the heap
    for c in chunks:
        ctypes.memset(c, 1, 64 << 10)  # resident
    pin = libc.malloc(64 << 10)  # (a size no older hole fits) above them: their free space is
    ctypes.memset(pin, 1, 64 << 10)  # not the heap's top, so free() cannot trim it
    for c in chunks:
        libc.free(c)
    held = anonymous_bytes()
    release_freed_memory()
    returned = held - anonymous_bytes()
    libc.free(pin)
    assert returned > 30 * MB, f"release_freed_memory gave back {returned / MB:.1f} MB of 40 MB freed"


def test_the_engine_releases_memory_once_when_it_goes_idle(checkpoint_dir, monkeypatch):
    llm = LLM(checkpoint_dir("llama"), num_kv_blocks=64, block_size=8, max_num_seqs=4)
    engine = llm.llm_engine
    calls = []
    monkeypatch.setattr(engine.executor, "release_idle_memory", lambda: calls.append(engine.get_num_unfinished_requests()))
    engine.add_request("short", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("long", {"prompt_token_ids": [6, 7, 8]}, SamplingParams(max_tokens=6, ignore_eos=True))
    finished = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
                assert calls == ([0] if not engine.has_unfinished_requests() else []), calls
    assert finished == ["short", "long"] and calls == [0]
    engine.step()  # an idle step runs nothing: nothing more to give back
    assert calls == [0]
    llm.shutdown()


def test_an_engine_lets_go_of_its_model_when_it_is_dropped(checkpoint_dir):
    """The engine freezes what it loaded (gc.freeze), so anything of a model held in a reference
    cycle outlived its engine: each parameter's weight_loader (its layer's bound method) made
    one, and every LLM made again in one process kept the last one's weights (+42 MB a time
    for the demo model in float32, +3 GB for a 1.5B one). Dropped, an LLM's weights and KV
    cache go at once, by reference counting (frozen objects the cyclic collector never sees)."""
    import gc
    import weakref

    for kwargs in ({}, {"quantization": "int8"}):
        llm = LLM(checkpoint_dir("llama"), num_kv_blocks=16, block_size=8, **kwargs)
        llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        worker = llm.llm_engine.executor.worker
        model = worker.model_runner.model
        alive = [weakref.ref(x) for x in (model, *model.parameters(), *worker.cache_engine.device_cache)]
        del worker, model
        assert gc.get_freeze_count() > 0  # (the engine froze what it loaded)
        llm.shutdown()
        del llm
        assert not [r for r in alive if r() is not None], "freed only by the cyclic collector, if at all"
