"""How the packed tensors of an integer-quantized linear layer split under tensor parallelism.

A column-parallel layer splits its outputs, a row-parallel one its inputs. A format states,
per checkpoint tensor, which of its dimensions runs along that feature and how
(:data:`SPLIT_KINDS`); :func:`plan_split` turns a feature range into the slice of each tensor
a rank reads (:class:`Narrow`, or None for the whole tensor), refusing ranges that would cut
a packed word or a quantization group in two. The plan is what a loader reads from disk, so
no rank reads another rank's part.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# how a tensor dimension follows a split feature:
#   plain    one element per feature (scales' output dim, qweight's unpacked dim)
#   packed   `pack` features per element (int32 words of codes): the range must align to it
#   groups   one element per group of `group` features (scales and zeros along the input dim):
#            the range must start and end on a group boundary (or at the last feature)
#   whole    every rank needs all of it (g_idx under an output split; per-channel scales and
#            act-order scales under an input split)
SPLIT_KINDS = ("plain", "packed", "groups", "whole")


@dataclass(frozen=True, slots=True)
class Narrow:
    """The part of one checkpoint tensor a rank reads: `length` elements of `dim` from `start`."""

    dim: int
    start: int
    length: int


def tp_range(features: int, rank: int, world_size: int, what: str = "features"
             ) -> tuple[int, int]:
    """(start, length) of `rank`'s equal share of `features`."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is not a rank of world_size={world_size}")
    if features % world_size:
        raise ValueError(f"{what}={features} is not divisible by tensor_parallel_size={world_size}")
    length = features // world_size
    return rank * length, length


def _aligned(start: int, length: int, total: int, unit: int, why: str, layer: str) -> None:
    end = start + length
    if start % unit or (length % unit and end != total):
        raise ValueError(
            f"{layer or 'layer'}: the tensor-parallel split [{start}, {end}) of its {total} "
            f"features cuts {why} of {unit} in two; each rank's range must start and end on a "
            f"multiple of {unit} (choose a tensor_parallel_size that divides "
            f"{total // unit if total % unit == 0 else total} evenly)")


def plan_split(rules: dict[str, tuple[int, str]], start: int, length: int, total: int, *,
               pack: int = 1, group: int = 1, layer: str = "") -> dict[str, Narrow | None]:
    """Each tensor's slice for features [start, start + length) of `total`.

    `rules`: tensor name -> (its dimension along the feature, one of SPLIT_KINDS); `pack`:
    features per packed element; `group`: features per quantization group.
    """
    if start < 0 or length <= 0 or start + length > total:
        raise ValueError(f"{layer or 'layer'}: feature range [{start}, {start + length}) is not "
                         f"within its {total} features")
    plan: dict[str, Narrow | None] = {}
    for name, (dim, kind) in rules.items():
        if kind == "plain":
            plan[name] = Narrow(dim, start, length)
        elif kind == "packed":
            _aligned(start, length, total, pack, f"a packed int32 word of {pack} codes "
                     f"(name {name})", layer)
            plan[name] = Narrow(dim, start // pack, -(-length // pack))
        elif kind == "groups":
            _aligned(start, length, total, group, f"a quantization group (group_size {group}, "
                     f"tensor {name})", layer)
            plan[name] = Narrow(dim, start // group, -(-length // group))
        elif kind == "whole":
            plan[name] = None
        else:
            raise AssertionError(f"unknown split kind {kind!r}")
    return plan


def apply_plan(tensors: dict[str, torch.Tensor], plan: dict[str, Narrow | None]
               ) -> dict[str, torch.Tensor]:
    """This rank's tensors: each planned tensor narrowed (tensors not in the plan are not
    needed by the format and are dropped)."""
    out = {}
    for name, narrow in plan.items():
        if name not in tensors:
            continue  # an optional tensor the checkpoint does not hold
        t = tensors[name]
        out[name] = t if narrow is None else t.narrow(narrow.dim, narrow.start, narrow.length)
    return out
