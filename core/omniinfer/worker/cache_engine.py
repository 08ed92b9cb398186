"""The KV-cache tensors of one worker: device caches per local layer, host caches for swap."""

from __future__ import annotations

import torch

from omniinfer.attention.backend import AttentionBackend


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                dtype: torch.dtype) -> int:
    """Bytes of one block across all local layers (keys and values)."""
    return 2 * num_layers * block_size * num_kv_heads * head_size * torch.empty((), dtype=dtype).element_size()


class CacheEngine:
    def __init__(self, backend: type[AttentionBackend], num_layers: int, num_device_blocks: int,
                 num_host_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: torch.device, pin_memory: bool = False,
                 layer_windows: list[int | None] | None = None, num_window_blocks: int = 0):
        """`layer_windows` (with a window pool, engine/kv_groups.py): per local layer, its window
        or None; the sliding layers' caches then hold `num_window_blocks` blocks, and no layer
        has a host copy (such a model is never swapped out)."""
        self.backend = backend
        self.is_window = [w is not None for w in layer_windows] if layer_windows else [False] * num_layers
        assert len(self.is_window) == num_layers, (layer_windows, num_layers)

        def shape(num_blocks: int):
            return backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

        # zeros: padded reads of never-written slots must be finite (masked, but 0 * NaN = NaN)
        self.device_cache = [backend.allocate_kv_cache(shape(num_window_blocks if w else num_device_blocks),
                                                       dtype, device) for w in self.is_window]
        self.host_cache = [torch.empty(shape(num_host_blocks), dtype=dtype, device="cpu", pin_memory=pin_memory)
                           for _ in range(num_layers)] if num_host_blocks and not layer_windows else []

    @property
    def num_bytes(self) -> int:
        """Bytes of the device caches, all local layers."""
        return sum(c.numel() * c.element_size() for c in self.device_cache)

    def swap_out(self, device_to_host: torch.Tensor) -> None:
        for dev, host in zip(self.device_cache, self.host_cache):
            self.backend.swap_blocks(dev, host, device_to_host)

    def swap_in(self, host_to_device: torch.Tensor) -> None:
        for dev, host in zip(self.device_cache, self.host_cache):
            self.backend.swap_blocks(host, dev, host_to_device)

    def copy(self, src_to_dst: torch.Tensor, window: bool = False) -> None:
        """Copy-on-write in the full layers' caches (window: in the sliding layers', which have a
        pool of their own only with a window pool)."""
        caches = [c for c, w in zip(self.device_cache, self.is_window) if w == window]
        self.backend.copy_blocks(caches, src_to_dst)
