"""The small demo model shipped with the package: its path, for scripts and tests."""

from __future__ import annotations

import os

_ASSETS = os.path.join(os.path.dirname(__file__), "assets", "demo")


def _path(name: str) -> str:
    path = os.path.join(_ASSETS, name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"the demo {name} is not in this installation ({path}/config.json "
                                "is missing; scripts/train_demo_model.py writes it)")
    return path


def demo_model_path() -> str:
    """The directory of the shipped demo checkpoint (a tiny Llama and its tokenizer with a chat
    template), e.g. `LLM(omniinfer.demo_model_path())`. FileNotFoundError when this
    installation lacks it."""
    return _path("model")


def demo_draft_model_path() -> str:
    """The demo model's draft (for speculative decoding), like `demo_model_path()`."""
    return _path("draft")
