"""What the sampler does for structured outputs: mask the rows of constrained sequences, take
what they drew into their matchers, and start computing the next step's masks."""

from __future__ import annotations

import torch

from omniinfer.structured.mask import apply_bias, unpack_bias
from omniinfer.structured.state import bitmask_for, fill_masks


def has_grammar(md) -> bool:
    return any(seq.grammar is not None for seq in md.seqs) or any(
        s.seq.grammar is not None for s in md.spec_rows)


def mask_rows(logits: torch.Tensor, md, row_seqs: list[int] | None) -> torch.Tensor:
    """`logits` (one row per sampled token of md.seqs; `row_seqs`: the index in md.seqs of
    each row when rows repeat a forking sequence) with the refused tokens at -inf (a new
    tensor; the caller's logits are left as they were)."""
    states = [seq.grammar for seq in md.seqs]
    if all(s is None for s in states):
        return logits
    vocab = logits.shape[1]
    bias = fill_masks(states, vocab) if md.prefetch is None else md.prefetch.masks(states, vocab)
    if row_seqs is not None:
        bias = bias[torch.tensor(row_seqs)]
    return apply_bias(logits, bias)


def mask_spec_rows(scored: torch.Tensor, spec, prefetch) -> torch.Tensor:
    """The k + 1 scored rows of each drafted sequence masked by its grammar walked along its
    drafts (so a draft the grammar refuses has probability 0 and is rejected)."""
    if all(s.seq.grammar is None for s in spec):
        return scored
    if prefetch is not None:
        prefetch.join()  # the walk moves the matchers
    k = len(spec[0].draft_tokens)
    bitmask = bitmask_for(scored.shape[0], scored.shape[1])
    for i, s in enumerate(spec):
        if s.seq.grammar is not None:
            s.seq.grammar.fill_along(s.draft_tokens, bitmask, i * (k + 1))
    return apply_bias(scored, unpack_bias(bitmask, scored.shape[1]))


def after_sampling(md, out, vocab_size: int) -> None:
    """Each constrained sequence's matcher takes the tokens it drew (a row that forked its
    request drew for n new sequences, which replay their own token), then the masks of the
    next step start on the helper thread."""
    if md.prefetch is not None:
        md.prefetch.join()
    drawn = dict(zip(out.seq_ids, out.token_ids))
    for seq, n in zip(md.seqs, md.num_samples):
        if seq.grammar is not None and n == 1 and seq.seq_id not in out.failed:
            for token in drawn.get(seq.seq_id, ()):
                seq.grammar.accept(token)
    for s in md.spec_rows:
        if s.seq.grammar is not None and s.seq.seq_id not in out.failed:
            for token in drawn.get(s.seq.seq_id, ()):
                s.seq.grammar.accept(token)
    states = [seq.grammar for seq in md.seqs]
    if any(s is not None for s in states) and md.prefetch is not None:
        md.prefetch.start(states, vocab_size)

