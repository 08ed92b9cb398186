"""Weights in transparent huge pages.

Decode streams every weight once per token; with 4 KiB pages that is a TLB miss every 4 KiB.
Linux hands out 2 MiB pages to anonymous private memory advised ``MADV_HUGEPAGE`` (the default
THP mode, "madvise", gives them to nothing else), which reads 10-30% faster here
(docs/performance.md). So after loading, the big parameters are copied into one such mapping
(pages are faulted in as the copy proceeds and each old tensor is freed after its copy, so peak
memory grows by about one parameter, not by the model).

KV caches stay in ordinary pages (``torch.zeros``, every page touched at start-up): getting huge
pages costs the kernel compaction at the first touch (~0.3 s per 128 MiB here), which either
lands in the middle of serving or multiplies start-up time, for ~5% of decode attention.
"""

from __future__ import annotations

import mmap
import os

import torch

from omniinfer.logger import init_logger

logger = init_logger(__name__)
ENV_HUGE_PAGES = "OMNIINFER_CPU_HUGE_PAGES"  # "0" keeps the weights where torch put them
HUGE_PAGE = 2 << 20
MIN_BYTES = 1 << 20  # smaller parameters stay put
STREAMED_ATTRS = ("q8_weight", "ec_weight")  # linear methods' copies (not parameters) moved too
THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_unavailable() -> str | None:
    if os.environ.get(ENV_HUGE_PAGES, "1").strip() == "0":
        return f"switched off ({ENV_HUGE_PAGES}=0)"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "no MADV_HUGEPAGE on this OS"
    try:
        with open(THP_SETTING, encoding="utf-8") as f:
            if "[never]" in f.read():
                return "transparent huge pages are disabled (never)"
    except OSError:
        return f"{THP_SETTING} is not readable"
    return None


def _huge_mapping(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """An anonymous private mapping advised MADV_HUGEPAGE (zero-filled by the kernel) and a uint8
    tensor over it that starts on a 2 MiB boundary (the tensor keeps the mapping alive)."""
    arena = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE, 0, len(arena))
    buffer = torch.frombuffer(arena, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE
    return arena, buffer[offset: offset + nbytes]


def move_to_huge_pages(model: torch.nn.Module) -> mmap.mmap | None:
    """Copy the model's parameters of at least 1 MiB (and the `STREAMED_ATTRS` tensors its layers'
    linear methods hold) into one huge-page mapping (each starting on a 4 KiB boundary) and point
    them at it. Returns the mapping (keep it alive with the model), or None when nothing moved."""
    why = huge_pages_unavailable()
    if why:
        logger.debug("weights stay in 4 KiB pages: %s", why)
        return None
    params = [p for p in model.parameters() if p.device.type == "cpu"
              and p.numel() * p.element_size() >= MIN_BYTES]
    # big tensors a kernel streams beside the parameters (the LM head's int8 copy, coded copies)
    methods = {id(m.linear_method): m.linear_method for m in model.modules() if hasattr(m, "linear_method")}
    streamed = [(m, name) for m in methods.values() for name in STREAMED_ATTRS
                if isinstance(getattr(m, name, None), torch.Tensor)
                and getattr(m, name).numel() * getattr(m, name).element_size() >= MIN_BYTES]
    tensors = params + [getattr(m, name) for m, name in streamed]
    sizes = [-(-t.numel() * t.element_size() // 4096) * 4096 for t in tensors]
    if not tensors:
        return None
    arena, buffer = _huge_mapping(sum(sizes))
    offset = 0
    for i, (tensor, size) in enumerate(zip(tensors, sizes)):
        nbytes = tensor.numel() * tensor.element_size()
        target = buffer[offset: offset + nbytes].view(tensor.dtype).view(tensor.shape)
        target.copy_(tensor.data)
        if i < len(params):
            tensor.data = target
        else:
            method, name = streamed[i - len(params)]
            setattr(method, name, target)
        offset += size
    logger.debug("%d tensors (%.2f GiB) moved to huge pages", len(tensors), sum(sizes) / 2**30)
    return arena
