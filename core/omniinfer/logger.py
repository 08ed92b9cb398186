"""Logging set-up shared by the core and the plugins."""

import logging
import os
import sys

_ROOT = "omniinfer"
_configured = False


def _configure_root() -> None:
    global _configured
    if _configured:
        return
    _configured = True
    root = logging.getLogger(_ROOT)
    level = os.environ.get("OMNIINFER_LOG_LEVEL", "INFO").upper()
    root.setLevel(level)
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(levelname)s %(asctime)s %(name)s] %(message)s", "%m-%d %H:%M:%S")
        )
        root.addHandler(handler)
    root.propagate = os.environ.get("OMNIINFER_LOG_PROPAGATE", "0") == "1"


def init_logger(name: str) -> logging.Logger:
    """A logger under the `omniinfer` hierarchy (plugins pass their module name too)."""
    _configure_root()
    if name != _ROOT and not name.startswith(_ROOT + "."):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)
