"""Vocabulary-parallel embedding and LM head: each TP rank holds a contiguous vocab range."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omniinfer.distributed import parallel_state as ps
from omniinfer.models.layers.linear import DEFAULT_LINEAR_METHOD
from omniinfer.models.layers.weights import (
    WeightShapeError,
    copy_checked,
    narrow,
    shape_of,
    weight_device,
)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.tp_size, self.tp_rank = ps.get_tp_size(), ps.get_tp_rank()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // self.tp_size)  # padded: last rank may hold fewer real rows
        self.start = self.tp_rank * self.per_rank
        self.num_real = max(0, min(self.per_rank, vocab_size - self.start))
        device = weight_device()
        self.weight = nn.Parameter((torch.empty if device else torch.zeros)(self.per_rank, hidden_size, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.qweight = None  # a quantised table (omniinfer.quantization) instead of `weight`

    def weight_loader(self, param, loaded, shard_id=None) -> None:
        shape = shape_of(loaded)
        if shape[0] != self.vocab_size or shape[1] != param.shape[1]:
            raise WeightShapeError(f"expected shape ({self.vocab_size}, {param.shape[1]}), "
                                   f"checkpoint has {shape}")
        copy_checked(param.data[: self.num_real], narrow(loaded, 0, self.start, self.num_real), "weight")

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:  # only the rows asked for are dequantised
            return self.qweight.rows_of(ids.reshape(-1), self.weight.dtype).reshape(*ids.shape, -1)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_real)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside[:, None], 0)
        return ps.tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = hidden @ W^T over this rank's vocab range, gathered to the full vocabulary.
    The product is the layer's `linear_method`, as for the linear layers."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.linear_method = DEFAULT_LINEAR_METHOD

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear_method.apply(self, hidden)
        if self.tp_size > 1:
            logits = ps.tp_all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor, argmax_rows) -> torch.Tensor:
        """argmax_rows(compute_logits(hidden)), the same tokens; with one TP rank (its rows are
        the whole vocabulary) through the linear method's `apply_argmax`, which may skip the
        logits."""
        if self.tp_size == 1 and self.per_rank == self.vocab_size:
            return self.linear_method.apply_argmax(self, hidden, argmax_rows)
        return argmax_rows(self.compute_logits(hidden))
