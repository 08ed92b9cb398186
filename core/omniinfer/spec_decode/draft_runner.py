"""The draft model runner: k forward passes back to back from one batch description.

The first pass catches each sequence's draft cache up (the tokens the draft has not seen,
usually one or two) and drafts one token; every later pass is the batch one token ahead
(`CommonAttentionMetadata.next_decode_step`, on the device), built by the draft's backend as
any batch is. Nothing goes back through the scheduler or the input builder, and the drafted
tokens stay on the device until all k passes are done.
"""

from __future__ import annotations

import numpy as np
import torch

from omniinfer.attention.common import build_common
from omniinfer.distributed import parallel_state as ps
from omniinfer.sampling.processing import SampleRow, draw, sampling_probs
from omniinfer.worker.model_input import ModelInput
from omniinfer.worker.model_runner import ModelRunner


class DraftModelRunner(ModelRunner):
    captures_graphs = False

    def load_model(self, progress: bool = True) -> None:
        with ps.single_rank():  # whole, on the driver, whatever the target's TP/PP layout
            super().load_model(progress)

    def first_pass_input(self, chunks: list[list[int]], context_lens: list[int],
                         block_tables: list[list[int]]) -> ModelInput:
        """Catch-up input: per sequence, the tokens after what its draft cache holds. Sequences
        with a single token after a cached context must come last (decodes after prefills)."""
        query_lens = [len(c) for c in chunks]
        num_prefills = sum(1 for q, ctx in zip(query_lens, context_lens) if not (q == 1 and ctx > 0))
        common = build_common(context_lens, query_lens, block_tables, num_prefills, self.block_size,
                              self.attn_builder.needs_prefill_key_slots)
        return ModelInput(
            input_tokens=torch.tensor([t for c in chunks for t in c], dtype=torch.int64),
            input_positions=common.positions,
            attn_metadata=self.attn_builder.build(common),
            logits_indices=torch.from_numpy(np.cumsum(np.asarray(query_lens, np.int64)) - 1),
            common=common,
        )

    @torch.inference_mode()
    def propose(self, first: ModelInput, rows: list[SampleRow], k: int, kv_caches: list[torch.Tensor],
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """k drafted tokens [B, k] and the distributions they were drawn from [B, k, vocab]
        (None when every request is greedy: the verifier then only compares argmaxes)."""
        vocab = self.model_config.vocab_size
        model_input = first.to(self.device)
        common = first.common.to(self.device)
        greedy_only = all(row.params.is_greedy for row in rows)
        tokens, probs = [], []
        for step in range(k):
            if greedy_only:  # straight from the LM head, which may skip the logits
                t = self.execute_model(model_input, kv_caches, greedy_tokens=True)
            else:
                logits = self.execute_model(model_input, kv_caches)[:, :vocab]
                p = sampling_probs(logits, rows, history=False)
                t = draw(p, rows, generator)
                probs.append(p)
            tokens.append(t)
            if step + 1 == k:
                break
            common = common.next_decode_step()
            model_input = ModelInput(
                input_tokens=t, input_positions=common.positions,
                attn_metadata=self.attn_builder.build(common).to(self.device),
                logits_indices=torch.arange(common.num_seqs, device=t.device), common=common)
        return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)
