"""omniinfer: one LLM inference engine, device plugins for every vendor.

The heavy names (`LLM`, `SamplingParams`, ...) import torch; they are resolved lazily so
that `import omniinfer` and `omniinfer --version` stay fast.
"""

from omniinfer.version import __version__

__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "LLMEngine",
    "EngineArgs",
    "demo_model_path",
    "demo_draft_model_path",
    "__version__",
]

_LAZY = {
    "LLM": "omniinfer.entrypoints.llm",
    "SamplingParams": "omniinfer.sampling.params",
    "RequestOutput": "omniinfer.engine.outputs",
    "CompletionOutput": "omniinfer.engine.outputs",
    "LLMEngine": "omniinfer.engine.llm_engine",
    "EngineArgs": "omniinfer.config",
    "demo_model_path": "omniinfer.demo",  # no torch: the path of the shipped demo checkpoint
    "demo_draft_model_path": "omniinfer.demo",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'omniinfer' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
