"""The kit's example backend (example_backend.py) passes the kit, on the CPU, in every run: what a
backend author copies is known to work."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omniinfer.testing.conformance import test_kv_write, test_metadata
from omniinfer.testing.conformance.cases import Case, assert_matches_reference, run_case
from omniinfer.testing.conformance.example_backend import ExampleBackend
from omniinfer.testing.conformance.test_numerics import CHUNKED, DECODE, MIXED, PREFILL

EXAMPLE = SimpleNamespace(backend=lambda name: ExampleBackend, device=torch.device("cpu"),
                          runnable={"EXAMPLE": torch.float32})


@pytest.mark.parametrize("case", [Case("prefill", PREFILL), Case("decode", DECODE, group=4),
                                  Case("mixed", MIXED, block_size=8),
                                  Case("chunked", CHUNKED, sliding_window=7)],
                         ids=["prefill", "decode", "mixed", "chunked-window"])
def test_example_matches_the_reference(case):
    assert_matches_reference(run_case(ExampleBackend, case, "cpu", torch.float32), torch.float32)


@pytest.mark.parametrize("check", [name for name in dir(test_metadata) if name.startswith("test_")]
                         + ["test_writes_exactly_the_step_tokens"])
def test_example_keeps_the_kits_invariants(check):
    module = test_metadata if hasattr(test_metadata, check) else test_kv_write
    getattr(module, check)(EXAMPLE, "EXAMPLE")
