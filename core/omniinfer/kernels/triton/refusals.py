"""What the ahead-of-time check found a target cannot run, as a table backends consult.

A configuration that does not compile for a target, spills there, or needs more shared memory
than the target has is listed here with the reason; the backends built on the kernels refuse
matching specs on such a device (``validate()`` returns the reason, so the selector explains
it), without compiling anything at run time. The check (``python -m
omniinfer.testing.kernels_aot``, run by the default test suite) keeps the table honest: a
failing catalogued configuration missing from it, or an entry that no longer matches a
failure, fails the check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from omniinfer.kernels.triton.catalogue import target_for_arch


@dataclass(frozen=True, slots=True)
class KnownFailure:
    """Configurations of `op` that `targets` cannot run, and why."""

    op: str  # a catalogued op (catalogue.KernelLaunch.op)
    targets: tuple[str, ...]  # catalogue target names: "sm_80", "gfx942"
    applies: Callable[[object], bool]  # an AttentionSpec or catalogue shape -> whether it is one
    reason: str  # what the check found, e.g. "spills 96 bytes (ptxas)"


# Empty: every catalogued configuration compiles for every target without spills or overflow
# (the check's report in the test output shows the margins). An entry looks like
#   KnownFailure("paged_prefill_attention", ("gfx90a",),
#                lambda s: s.dtype == torch.float32 and s.head_size > 128,
#                "needs 80 KiB of LDS, gfx90a has 64 KiB")
KNOWN_FAILURES: tuple[KnownFailure, ...] = ()


def refusal_reasons(spec, ops: Iterable[str], table: tuple[KnownFailure, ...] | None = None
                    ) -> list[str]:
    """Why a device of `spec.device_arch` cannot run `ops` (catalogued op names) for `spec`
    (empty: nothing known). `table` defaults to KNOWN_FAILURES."""
    target = target_for_arch(getattr(spec, "device_arch", None))
    if target is None:
        return []
    ops = tuple(ops)
    return [f"{entry.op} cannot run this configuration on {target.name}: {entry.reason}"
            for entry in (KNOWN_FAILURES if table is None else table)
            if entry.op in ops and target.name in entry.targets and entry.applies(spec)]
