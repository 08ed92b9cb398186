"""Each tensor-parallel rank loads exactly its shard, read straight from safetensors slices,
and each pipeline stage holds only its layers (no processes: the rank is set by hand)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from omniinfer.attention.backends.torch_sdpa import TorchSDPABackend
from omniinfer.config import EngineArgs
from omniinfer.distributed import parallel_state as ps
from omniinfer.models.layers.weights import CheckpointTensor
from omniinfer.models.loader import load_model


def load_as(monkeypatch, path: str, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0):
    config = EngineArgs(model=path, tensor_parallel_size=tp_size,
                        pipeline_parallel_size=pp_size).create_engine_config()
    monkeypatch.setattr(ps, "_STATE", ps.ParallelGroups(tp_size=tp_size, tp_rank=tp_rank,
                                                        pp_size=pp_size, pp_rank=pp_rank))
    return load_model(config.model, TorchSDPABackend, torch.device("cpu"), progress=False), config


def rows(t: torch.Tensor, rank: int, parts: int) -> torch.Tensor:
    return t.chunk(parts, dim=0)[rank]


@pytest.mark.parametrize("name,tp", [("llama", 2), ("llama", 4), ("qwen2", 2), ("llama_kv1", 2),
                                     ("llama_kv1", 4)])
def test_each_rank_loads_its_shard_from_slices(name, tp, checkpoint_dir, monkeypatch):
    path = checkpoint_dir(name)
    full = load_file(os.path.join(path, "model.safetensors"))
    whole_reads = []
    original = CheckpointTensor.full
    monkeypatch.setattr(CheckpointTensor, "full",
                        lambda self: whole_reads.append(self.name) or original(self))
    for rank in range(tp):
        model, config = load_as(monkeypatch, path, tp_size=tp, tp_rank=rank)
        m = config.model
        heads, kv = m.num_heads // tp, m.num_kv_heads
        kv_index = rank // (tp // kv) if kv < tp else rank  # which KV slice (replicated when kv < tp)
        kv_parts = min(kv, tp)
        params = dict(model.named_parameters())
        for i in range(m.num_layers):
            pre = f"model.layers.{i}."
            q, k, v = (full[f"{pre}self_attn.{p}_proj.weight"] for p in "qkv")
            expected = torch.cat([rows(q, rank, tp), rows(k, kv_index, kv_parts),
                                  rows(v, kv_index, kv_parts)])
            assert heads * m.head_size == rows(q, rank, tp).shape[0]
            assert torch.equal(params[pre + "self_attn.qkv_proj.weight"], expected)
            if name == "qwen2":
                qb, kb, vb = (full[f"{pre}self_attn.{p}_proj.bias"] for p in "qkv")
                assert torch.equal(params[pre + "self_attn.qkv_proj.bias"], torch.cat(
                    [rows(qb, rank, tp), rows(kb, kv_index, kv_parts), rows(vb, kv_index, kv_parts)]))
            o = full[pre + "self_attn.o_proj.weight"]
            assert torch.equal(params[pre + "self_attn.o_proj.weight"], o.chunk(tp, dim=1)[rank])
            gate, up = full[pre + "mlp.gate_proj.weight"], full[pre + "mlp.up_proj.weight"]
            assert torch.equal(params[pre + "mlp.gate_up_proj.weight"],
                               torch.cat([rows(gate, rank, tp), rows(up, rank, tp)]))
            down = full[pre + "mlp.down_proj.weight"]
            assert torch.equal(params[pre + "mlp.down_proj.weight"], down.chunk(tp, dim=1)[rank])
        per_rank = -(-m.vocab_size // tp)
        for ours, theirs in (("model.embed_tokens.weight", "model.embed_tokens.weight"),
                             ("lm_head.weight", "lm_head.weight")):
            shard = full[theirs][rank * per_rank:(rank + 1) * per_rank]
            assert torch.equal(params[ours][: shard.shape[0]], shard)
            assert not params[ours][shard.shape[0]:].any()  # padding rows stay zero
    # only unsplit 1-D tensors (the norms) are ever read whole
    assert whole_reads and all(n.endswith("norm.weight") for n in whole_reads)


@pytest.mark.parametrize("name", ["llama", "llama_tied"])
def test_pipeline_stages_hold_only_their_layers(name, checkpoint_dir, monkeypatch):
    path = checkpoint_dir(name)
    first, _ = load_as(monkeypatch, path, pp_size=2, pp_rank=0)
    last, _ = load_as(monkeypatch, path, pp_size=2, pp_rank=1)
    assert list(first.model.layers) == ["0"] and list(last.model.layers) == ["1"]
    assert first.num_local_layers == last.num_local_layers == 1
    assert hasattr(first.model, "embed_tokens") and not hasattr(first, "lm_head")
    assert not hasattr(first.model, "norm") and hasattr(last.model, "norm")
    # the last stage has an embedding only to hold the tied LM head
    assert hasattr(last.model, "embed_tokens") == (name == "llama_tied")
