"""Packing integer codes into int32 words, and back: the bit layouts the checkpoint formats use.

Every format here packs ``32 // bits`` codes per int32, code ``j`` of a word at bits
``[j * bits, (j + 1) * bits)`` (little-endian order), along one dimension of a 2-D tensor;
AWQ additionally permutes the eight codes of a word (``AWQ_ORDER``). A word whose top code is
8 or more is a negative int32; the codes are read back with a mask, so the sign does not
matter. Codes are unsigned (0 .. 2**bits - 1); compressed-tensors' signed codes are offset by
``2**(bits - 1)`` before packing, as its own packer does.
"""

from __future__ import annotations

import torch

SUPPORTED_PACK_BITS = (4, 8)
# AutoAWQ's GEMM layout: slot i of a word holds column AWQ_ORDER[i] of its group of eight
# (WQLinear_GEMM.from_linear); AWQ_SLOT_OF_COLUMN is the inverse (column j is in slot ...).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_SLOT_OF_COLUMN = (0, 4, 1, 5, 2, 6, 3, 7)


def pack_factor(bits: int) -> int:
    if bits not in SUPPORTED_PACK_BITS:
        raise ValueError(f"bits={bits} cannot be packed here; supported: {SUPPORTED_PACK_BITS}")
    return 32 // bits


def pack_int32(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack unsigned `codes` (any integer dtype, values < 2**bits) of a 2-D tensor along `dim`
    into int32 words; a ragged end is padded with zero codes."""
    pf = pack_factor(bits)
    codes = codes.to(torch.int64)
    if dim == 0:
        return pack_int32(codes.t(), bits, 1).t().contiguous()
    if codes.dim() != 2 or dim != 1:
        raise ValueError(f"pack_int32 packs 2-D tensors along dim 0 or 1, got shape "
                         f"{tuple(codes.shape)} and dim={dim}")
    if bool(((codes < 0) | (codes >= 1 << bits)).any()):
        raise ValueError(f"codes must lie in [0, {1 << bits}) to pack {bits} bits")
    rows, cols = codes.shape
    padded = -(-cols // pf) * pf
    codes = torch.nn.functional.pad(codes, (0, padded - cols)).view(rows, padded // pf, pf)
    shifts = torch.arange(pf, dtype=torch.int64) * bits
    words = (codes << shifts).sum(-1)  # < 2**32, exact in int64
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # the int32 of those bits
    return words.to(torch.int32)


def unpack_int32(words: torch.Tensor, bits: int, dim: int, size: int) -> torch.Tensor:
    """The unsigned codes (int32) of int32 `words` packed along `dim`; `size` codes along it."""
    pf = pack_factor(bits)
    if words.dtype != torch.int32:
        raise TypeError(f"packed words must be int32, got {words.dtype}")
    if dim == 0:
        return unpack_int32(words.t(), bits, 1, size).t().contiguous()
    shifts = torch.arange(pf, dtype=torch.int32, device=words.device) * bits
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.reshape(words.shape[0], -1)
    if size > codes.shape[1]:
        raise ValueError(f"{words.shape[1]} packed words hold {codes.shape[1]} codes, not {size}")
    return codes[:, :size]


def awq_to_natural(codes: torch.Tensor) -> torch.Tensor:
    """Columns unpacked from an AWQ word (slot order) into their natural order."""
    n = codes.shape[1]
    if n % 8:
        raise ValueError(f"AWQ packs columns in groups of 8, got {n} columns")
    index = torch.arange(n, device=codes.device).view(-1, 8)[:, list(AWQ_SLOT_OF_COLUMN)]
    return codes[:, index.reshape(-1)]


def natural_to_awq(codes: torch.Tensor) -> torch.Tensor:
    """The inverse of `awq_to_natural`: columns in slot order, ready for `pack_int32(..., 1)`."""
    n = codes.shape[1]
    if n % 8:
        raise ValueError(f"AWQ packs columns in groups of 8, got {n} columns")
    index = torch.arange(n, device=codes.device).view(-1, 8)[:, list(AWQ_ORDER)]
    return codes[:, index.reshape(-1)]
