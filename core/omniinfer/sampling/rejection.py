"""Modified rejection sampling: keep the target's distribution exactly while accepting drafts.

For each drafted position i (draft token d_i drawn from q_i): accept with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw the replacement from the
normalised residual max(0, p_i - q_i) and stop; when all k are accepted, draw a bonus token
from p_k. Greedy rows have one-hot p and q, which reduces this to prefix matching against
the target's argmax. Seeded requests take their uniforms (acceptance tests and draws) from
their own generator, so they stay deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniinfer.sampling.processing import SampleRow, draw, uniforms


@dataclass(slots=True)
class RejectionResult:
    num_accepted: list[int]  # per sequence: leading drafts kept (0..k)
    tokens: list[list[int]]  # per sequence: the kept drafts and then one drawn token


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor, rows: list[SampleRow],
                     generator: torch.Generator | None = None) -> RejectionResult:
    """target_probs [B, k+1, V], draft_tokens [B, k] int64, draft_probs [B, k, V];
    rows: one per sequence (its seeded generator and parameters)."""
    num_seqs, k = draft_tokens.shape
    device = target_probs.device
    if k == 0:
        last = draw(target_probs[:, 0], rows, generator)
        return RejectionResult([0] * num_seqs, [[t] for t in last.tolist()])
    p_d = target_probs[:, :k].gather(2, draft_tokens[..., None])[..., 0]
    q_d = draft_probs.gather(2, draft_tokens[..., None])[..., 0]
    u = uniforms(rows, k, device, generator)
    accepted = (u * q_d < p_d).long()  # u < p/q without dividing by q
    num_accepted = accepted.cumprod(dim=1).sum(dim=1)  # leading run of acceptances
    at = num_accepted.clamp(max=k - 1)
    index = torch.arange(num_seqs, device=device)
    residual = (target_probs[index, at] - draft_probs[index, at]).clamp(min=0)
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), target_probs[index, at])
    all_in = (num_accepted == k)[:, None]
    final = torch.where(all_in, target_probs[:, k], residual)
    last = draw(final, rows, generator)
    counts = num_accepted.tolist()
    drafts = draft_tokens.tolist()
    tokens = [drafts[i][:a] + [t] for i, (a, t) in enumerate(zip(counts, last.tolist()))]
    return RejectionResult(counts, tokens)
