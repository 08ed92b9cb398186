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
                 dtype: torch.dtype, device: torch.device, pin_memory: bool = False):
        self.backend = backend
        shape = backend.get_kv_cache_shape(num_device_blocks, block_size, num_kv_heads, head_size)
        # zeros: padded reads of never-written slots must be finite (masked, but 0 * NaN = NaN)
        self.device_cache = [backend.allocate_kv_cache(shape, dtype, device) for _ in range(num_layers)]
        host_shape = backend.get_kv_cache_shape(num_host_blocks, block_size, num_kv_heads, head_size)
        self.host_cache = [torch.empty(host_shape, dtype=dtype, device="cpu", pin_memory=pin_memory)
                           for _ in range(num_layers)] if num_host_blocks else []

    def swap_out(self, device_to_host: torch.Tensor) -> None:
        for dev, host in zip(self.device_cache, self.host_cache):
            self.backend.swap_blocks(dev, host, device_to_host)

    def swap_in(self, host_to_device: torch.Tensor) -> None:
        for dev, host in zip(self.device_cache, self.host_cache):
            self.backend.swap_blocks(host, dev, host_to_device)

    def copy(self, src_to_dst: torch.Tensor) -> None:
        self.backend.copy_blocks(self.device_cache, src_to_dst)
