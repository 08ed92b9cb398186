"""Drafting, in the driver worker: which sequences get drafts this step, the draft model and
its own KV cache, and how far each draft cache is valid.

The draft shares the target's block tables (same block ids) over its own, smaller cache
tensors, so the scheduler's allocation (with k lookahead slots per decode) covers both; the
scheduler names the decodes with room for k drafts (`SchedulerOutput.spec_seq_ids`). It runs
on the driver only, whatever the target's parallel layout, set up as the worker sets up the
target (attention backend, runner, cache).
"""

from __future__ import annotations

import dataclasses

import torch

from omniinfer.config import EngineConfig
from omniinfer.sampling.metadata import SeqStates
from omniinfer.sampling.processing import SampleRow
from omniinfer.spec_decode.draft_runner import DraftModelRunner
from omniinfer.step import ModelRunnerOutput, SchedulerOutput
from omniinfer.worker.cache_engine import CacheEngine


def check_same_vocabulary(target_tokenizer, draft_dir: str) -> None:
    """A draft with its own tokenizer must have exactly the target's vocabulary."""
    import os

    if not any(os.path.isfile(os.path.join(draft_dir, f))
               for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return
    from transformers import AutoTokenizer

    draft = AutoTokenizer.from_pretrained(draft_dir)
    if draft.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"speculative_model={draft_dir!r} has a different tokenizer vocabulary "
                         "from the target model; the draft must share the target's tokenizer")


class DraftProposer:
    def __init__(self, config: EngineConfig, platform: type, attn_backend: type, device: torch.device,
                 progress: bool = True):
        self.k = config.speculative.num_speculative_tokens
        self.config = dataclasses.replace(config, model=config.speculative.draft)
        self.device = device
        self.runner = DraftModelRunner(self.config, attn_backend, device, platform=platform)
        self.runner.load_model(progress=progress)
        self.cache: CacheEngine | None = None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(config.model.seed + 1)
        self.computed: dict[int, int] = {}  # seq_id -> tokens its draft cache holds
        self.pending: dict[int, int] = {}  # seq_id -> its tokens when drafted this step

    def initialize_cache(self, num_blocks: int) -> None:
        draft = self.config.model
        self.cache = CacheEngine(self.runner.attn_backend, self.runner.num_local_layers, num_blocks,
                                 0, self.config.cache.block_size, draft.num_kv_heads, draft.head_size,
                                 draft.dtype, self.device)

    def forget(self, seq_id: int) -> None:
        """The sequence finished, or was preempted (its draft cache is gone with its blocks)."""
        self.computed.pop(seq_id, None)

    def propose(self, sched: SchedulerOutput, states: SeqStates):
        """k drafted tokens (and their distributions) for every decode the scheduler allows."""
        if sched.blocks_to_copy:  # copy-on-write applies to the draft's cache too
            self.cache.copy(torch.tensor(sched.blocks_to_copy, dtype=torch.int64, device=self.device))
        self.pending = {}
        entries = []
        for i, seq_id in enumerate(sched.seq_ids):
            if seq_id in sched.spec_seq_ids:
                cached = self.computed.get(seq_id, 0)
                token_ids = states[seq_id].token_ids
                entries.append((seq_id, token_ids[cached:], cached, sched.block_tables[i], len(token_ids)))
        if not entries:
            return None
        entries.sort(key=lambda e: len(e[1]) == 1 and e[2] > 0)  # catch-ups first, decodes last
        first = self.runner.first_pass_input([e[1] for e in entries], [e[2] for e in entries],
                                             [e[3] for e in entries])
        rows = [SampleRow(states[e[0]], states[e[0]].index) for e in entries]
        tokens, probs = self.runner.propose(first, rows, self.k, self.cache.device_cache, self.generator)
        drafts = {}
        for i, token_list in enumerate(tokens.tolist()):  # the one device-to-host copy
            seq_id = entries[i][0]
            drafts[seq_id] = (token_list, None if probs is None else probs[i])
            self.pending[seq_id] = entries[i][4]
        return drafts

    def after_step(self, output: ModelRunnerOutput) -> None:
        """Record how far each draft cache is valid, and the step's drafting counts."""
        if not self.pending:
            return
        new_tokens = dict(zip(output.seq_ids, output.token_ids))
        accepted_total = 0
        for seq_id, n in self.pending.items():
            accepted = len(new_tokens[seq_id]) - 1 if seq_id in new_tokens else 0
            self.computed[seq_id] = n + min(accepted, self.k - 1)
            accepted_total += accepted
        output.num_drafted_seqs = len(self.pending)
        output.num_draft_tokens = self.k * len(self.pending)
        output.num_accepted_tokens = accepted_total
