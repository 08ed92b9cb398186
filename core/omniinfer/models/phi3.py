"""Phi-3: the Llama decoder, with q/k/v fused in one checkpoint tensor (`qkv_proj`) and gate/up
in another (`gate_up_proj`), and the `longrope` (or `su`) rope scaling. The fused tensors are
cut into their shards as they load, so tensor parallelism splits each shard as Llama's."""

from __future__ import annotations

from collections.abc import Iterable

from omniinfer.models.layers.weights import narrow, shape_of, tensor_of
from omniinfer.models.llama import LlamaForCausalLM


class RowRange:
    """Rows [start, start + length) of a (lazily read) checkpoint tensor, as a tensor of its own."""

    def __init__(self, loaded, start: int, length: int):
        self.loaded, self.start, self.length = loaded, start, length
        self.shape = (length, *shape_of(loaded)[1:])

    def narrow(self, dim: int, start: int, length: int):
        if dim == 0:
            return narrow(self.loaded, 0, self.start + start, length)
        return self.full().narrow(dim, start, length)

    def full(self):
        return narrow(self.loaded, 0, self.start, self.length) if hasattr(self.loaded, "narrow") \
            else tensor_of(self.loaded)[self.start:self.start + self.length]


class Phi3ForCausalLM(LlamaForCausalLM):
    def _split(self, name: str, loaded):
        cfg = self.config
        if ".qkv_proj." in name:
            q, kv = cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
            sizes = (("q", 0, q), ("k", q, kv), ("v", q + kv, kv))
        else:
            inter = int(cfg.hf_config["intermediate_size"])
            sizes = ((0, 0, inter), (1, inter, inter))
        rows = shape_of(loaded)[0]
        if rows != sum(s[2] for s in sizes):
            raise KeyError(name)  # reported by the loader as not belonging to the model
        return [(shard, RowRange(loaded, start, length)) for shard, start, length in sizes]

    def load_weights(self, weights: Iterable[tuple[str, object]]) -> set[str]:
        def unfused():
            for name, loaded in weights:
                if ".qkv_proj." in name or ".gate_up_proj." in name:
                    for shard, part in self._split(name, loaded):
                        yield _ShardName(name, shard), part
                else:
                    yield name, loaded

        return super().load_weights(unfused())

    def checkpoint_target(self, name):
        if isinstance(name, _ShardName):
            target = super().checkpoint_target(str(name))
            return None if target is None else (target[0], name.shard)
        return super().checkpoint_target(name)


class _ShardName(str):
    """A fused checkpoint tensor's name, carrying which shard of it this part is."""

    def __new__(cls, name: str, shard):
        obj = super().__new__(cls, name)
        obj.shard = shard
        return obj
