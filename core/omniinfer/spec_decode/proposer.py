"""Drafting for the engine: which sequences get drafts this step, the draft's own KV cache,
and the acceptance statistics.

The draft shares the target's block tables (same block ids) over its own, smaller cache
tensors, so the scheduler's allocation (with k lookahead slots per decode) covers both. It
runs on the driver only, whatever the target's parallel layout.
"""

from __future__ import annotations

import dataclasses

import torch

from omniinfer.attention.selector import select_attention_backend
from omniinfer.config import EngineConfig
from omniinfer.engine.scheduler import ScheduledSeq, SchedulerOutput
from omniinfer.logger import init_logger
from omniinfer.sampling.processing import SampleRow
from omniinfer.sampling.sampler import SamplerOutput
from omniinfer.spec_decode.draft_runner import DraftModelRunner
from omniinfer.worker.cache_engine import CacheEngine

logger = init_logger(__name__)


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
    def __init__(self, config: EngineConfig, platform: type, backends: dict, num_blocks: int,
                 progress: bool = True):
        spec_config = config.speculative
        self.k = spec_config.num_speculative_tokens
        self.max_model_len = config.model.max_model_len
        draft = spec_config.draft
        draft_config = dataclasses.replace(config, model=draft)
        spec = platform.attention_spec(
            dtype=draft.dtype, head_size=draft.head_size, num_heads=draft.num_heads,
            num_kv_heads=draft.num_kv_heads, block_size=config.cache.block_size,
            sliding_window=draft.sliding_window)
        backend = select_attention_backend(platform, spec, backends, config.device.attention_backend)
        self.device = platform.device(0)
        self.runner = DraftModelRunner(draft_config, backend, self.device)
        self.runner.load_model(progress=progress)
        self.cache = CacheEngine(backend, self.runner.num_local_layers, num_blocks, 0,
                                 config.cache.block_size, draft.num_kv_heads, draft.head_size,
                                 draft.dtype, self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.model.seed + 1)
        self.computed: dict[int, tuple[int, int]] = {}  # seq_id -> (num_preemptions, cached tokens)
        self.pending: dict[int, int] = {}  # seq_id -> num_tokens when drafted this step
        self.num_proposed = self.num_accepted = self.num_emitted = self.num_draft_steps = 0

    def _eligible(self, s: ScheduledSeq) -> bool:
        seq = s.seq
        group = seq.group
        return (s.num_new_tokens == 1 and s.is_sampling and seq.num_computed_tokens > 0
                and seq.num_computed_tokens == seq.num_tokens - 1
                and (group.params.n == 1 or group.is_forked)
                and seq.num_output_tokens + self.k + 1 <= group.max_tokens
                and seq.num_tokens + self.k <= self.max_model_len)

    def _draft_cached(self, seq) -> int:
        preemptions, cached = self.computed.get(seq.seq_id, (seq.num_preemptions, 0))
        return cached if preemptions == seq.num_preemptions else 0

    def propose(self, sched: SchedulerOutput, block_tables: dict[int, list[int]]) -> None:
        """Draft k tokens for every eligible decode; sets `spec_tokens`/`spec_probs` on them."""
        if sched.blocks_to_copy:  # copy-on-write applies to the draft's cache too
            self.cache.copy(torch.tensor(sched.blocks_to_copy, dtype=torch.int64, device=self.device))
        chosen = [s for s in sched.scheduled if self._eligible(s)]
        self.pending = {}
        if not chosen:
            return
        entries = []
        for s in chosen:
            cached = self._draft_cached(s.seq)
            entries.append((s, s.seq.token_ids[cached:], cached))
        entries.sort(key=lambda e: len(e[1]) == 1 and e[2] > 0)  # catch-ups first, decodes last
        first = self.runner.first_pass_input([e[1] for e in entries], [e[2] for e in entries],
                                             [block_tables[e[0].seq.seq_id] for e in entries])
        rows = [SampleRow(e[0].seq, e[0].seq.index) for e in entries]
        tokens, probs = self.runner.propose(first, rows, self.k, self.cache.device_cache, self.generator)
        for i, token_list in enumerate(tokens.tolist()):  # the one device-to-host copy
            s = entries[i][0]
            s.spec_tokens, s.spec_probs = token_list, (None if probs is None else probs[i])
            self.pending[s.seq.seq_id] = s.seq.num_tokens
        self.num_draft_steps += 1

    def after_step(self, sched: SchedulerOutput, result: SamplerOutput) -> None:
        """Record how far each draft cache is valid, and the acceptance counts."""
        for s in sched.scheduled:
            seq = s.seq
            if seq.seq_id not in self.pending:
                continue
            n = self.pending[seq.seq_id]
            sample = result.samples.get(seq.seq_id)
            accepted = sample.num_accepted if sample is not None and sample.num_accepted is not None else 0
            self.computed[seq.seq_id] = (seq.num_preemptions, n + min(accepted, self.k - 1))
            self.num_proposed += self.k
            self.num_accepted += accepted
            self.num_emitted += accepted + 1
        for s in sched.scheduled:
            if s.seq.is_finished:
                self.computed.pop(s.seq.seq_id, None)

    def forget(self, seq_id: int) -> None:
        self.computed.pop(seq_id, None)

    def stats(self) -> dict:
        return {
            "num_spec_proposed_tokens": self.num_proposed,
            "num_spec_accepted_tokens": self.num_accepted,
            "num_spec_emitted_tokens": self.num_emitted,
            "spec_acceptance_rate": self.num_accepted / self.num_proposed if self.num_proposed else 0.0,
            "num_spec_draft_steps": self.num_draft_steps,
        }
