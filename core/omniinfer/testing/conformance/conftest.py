"""Loads the kit's pytest hooks when pytest collects this package, unless they are already
loaded as a plugin (``-p omniinfer.testing.conformance.plugin``, which is what makes the
``--omniinfer-platform`` option available with ``--pyargs``: pytest reads a package's conftest
only after it has parsed the command line)."""

import sys

if "omniinfer.testing.conformance.plugin" not in sys.modules:
    from omniinfer.testing.conformance.plugin import (  # noqa: F401
        conformance,
        conformance_checkpoint,
        pytest_addoption,
        pytest_configure,
        pytest_generate_tests,
        pytest_report_header,
        transformers_greedy,
    )
