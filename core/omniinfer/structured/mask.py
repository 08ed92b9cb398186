"""The vendor-neutral grammar mask: int32 bitmask words -> a bool keep-mask -> -inf logits.

Plain torch ops, so every platform runs them on its own device. Measured on this project's CPU
(docs/structured_output.md): unpacking and applying a [16, 4096] mask costs ~0.2 ms on one
thread; the unpack half runs off the critical path (`state.MaskPrefetch`), so the step itself
pays only the `masked_fill_`. No C or Triton kernel: the measurement does not call for one.
"""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_keep(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool (True: the token is allowed)."""
    shifts = _SHIFTS if bitmask.device.type == "cpu" else _SHIFTS.to(bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_keep(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Logits of refused tokens set to -inf, in place (keep may be narrower than the logits'
    padded vocabulary: the padding is refused)."""
    if keep.device != logits.device:
        keep = keep.to(logits.device, non_blocking=True)
    vocab = keep.shape[1]
    if logits.shape[1] > vocab:
        logits[:, vocab:] = float("-inf")
    logits[:, :vocab].masked_fill_(~keep, float("-inf"))
    return logits
