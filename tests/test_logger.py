"""Plugins' log lines reach the configured `omniinfer` logger, with its level and format."""

from __future__ import annotations

import logging

from omniinfer.logger import init_logger


def test_plugin_loggers_are_under_the_configured_root():
    root = logging.getLogger("omniinfer")
    for name in ("omniinfer_cpu.kernels.build", "acme_plugin.platform", "omniinfer.engine", "omniinfer"):
        logger = init_logger(name)
        assert logger is root or logger.name.startswith("omniinfer."), name
        assert logger.getEffectiveLevel() == root.level
    assert root.handlers  # the one configured handler, with level and time in its format
    fmt = root.handlers[0].formatter._fmt
    assert "%(levelname)s" in fmt and "%(asctime)s" in fmt
    seen = []
    probe = logging.Handler()
    probe.emit = seen.append
    root.addHandler(probe)
    try:
        init_logger("omniinfer_cpu.kernels.build").info("building the CPU kernels")
    finally:
        root.removeHandler(probe)
    assert [r.getMessage() for r in seen] == ["building the CPU kernels"]
