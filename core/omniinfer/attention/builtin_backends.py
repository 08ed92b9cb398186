"""The backends the core itself provides (plugins add theirs through the hook)."""

from __future__ import annotations


def core_backends() -> list[type]:
    from omniinfer.attention.backends.torch_sdpa import TorchSDPABackend
    from omniinfer.attention.backends.triton import TritonBackend
    from omniinfer.attention.reference import ReferenceBackend

    return [TorchSDPABackend, ReferenceBackend, TritonBackend]
