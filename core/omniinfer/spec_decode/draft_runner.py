"""The draft model runner: k forward passes back to back on one model input.

The first pass catches each sequence's draft cache up (the tokens the draft has not seen,
usually one or two) and drafts one token; every later pass advances the same input in
place (next token, positions + 1, sequence lengths + 1, the next slot from the block
tables). Nothing goes back through the scheduler or the input builder, and the drafted
tokens stay on the device until all k passes are done.
"""

from __future__ import annotations

import numpy as np
import torch

from omniinfer.attention.common import positions_for
from omniinfer.distributed import parallel_state as ps
from omniinfer.sampling.processing import SampleRow, draw, sampling_probs
from omniinfer.worker.model_input import ModelInput
from omniinfer.worker.model_runner import ModelRunner


class DraftModelRunner(ModelRunner):
    def load_model(self, progress: bool = True) -> None:
        with ps.single_rank():  # whole, on the driver, whatever the target's TP/PP layout
            super().load_model(progress)

    def first_pass_input(self, chunks: list[list[int]], context_lens: list[int],
                         block_tables: list[list[int]]) -> ModelInput:
        """Catch-up input: per sequence, the tokens after what its draft cache holds. Sequences
        with a single token after a cached context must come last (decodes after prefills)."""
        builder = self.attn_backend.get_builder_cls()(self.block_size, self.model_config.sliding_window)
        query_lens = [len(c) for c in chunks]
        for chunk, ctx, table in zip(chunks, context_lens, block_tables):
            builder.add_seq(context_len=ctx, query_len=len(chunk), block_table=table,
                            is_prefill=not (len(chunk) == 1 and ctx > 0))
        q = np.asarray(query_lens, dtype=np.int64)
        return ModelInput(
            input_tokens=torch.tensor([t for c in chunks for t in c], dtype=torch.int64),
            input_positions=torch.from_numpy(positions_for(np.asarray(context_lens, np.int64), q)),
            attn_metadata=builder.build(),
            logits_indices=torch.from_numpy(np.cumsum(q) - 1),
        )

    @torch.inference_mode()
    def propose(self, first: ModelInput, rows: list[SampleRow], k: int, kv_caches: list[torch.Tensor],
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """k drafted tokens [B, k] and the distributions they were drawn from [B, k, vocab]
        (None when every request is greedy: the verifier then only compares argmaxes)."""
        vocab = self.model_config.vocab_size
        model_input = first.to(self.device)
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
            if step == 0:
                model_input = self._decode_input(model_input, t)
            else:
                model_input.input_tokens.copy_(t)
                model_input.input_positions += 1
                model_input.attn_metadata.advance_step(model_input.input_positions, self.block_size)
        return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)

    def _decode_input(self, first: ModelInput, tokens: torch.Tensor) -> ModelInput:
        md = first.attn_metadata
        return ModelInput(
            input_tokens=tokens.clone(),
            input_positions=md.seq_lens_tensor.long(),
            attn_metadata=md.next_decode_step(self.block_size),
            logits_indices=torch.arange(md.num_seqs, device=tokens.device),
        )
