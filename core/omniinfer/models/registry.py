"""Architecture name (config.json "architectures") -> model class, from the `omniinfer_models`
hook of every loaded plugin (the core's own models are the first provider, `models/builtin.py`).

A provider answers {name: "module:Class"} or {name: {"class": "module:Class", "override": True}}.
The first provider of a name keeps it; a later one is recorded as a conflict (reported by
`omniinfer env` and logged) unless it says `override`, in which case it replaces the earlier one.
Classes are imported on first use only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from omniinfer.logger import init_logger

logger = init_logger(__name__)
CORE_PROVIDER = "omniinfer"  # the name the core's own models are registered under


class ModelRegistryError(ValueError):
    """A provider's answer to `omniinfer_models()` that cannot be used."""


@dataclass(slots=True)
class ModelEntry:
    architecture: str
    target: str  # "package.module:Class"
    provider: str  # distribution (or plugin) name
    overrides: list[str] = field(default_factory=list)  # providers it replaced
    ignored: list[str] = field(default_factory=list)  # later providers of the name, not used

    def describe(self) -> str:
        text = f"{self.target} [{self.provider}]"
        if self.overrides:
            text += f" (overrides {', '.join(self.overrides)})"
        if self.ignored:
            text += (f" (also offered by {', '.join(self.ignored)}, ignored: "
                     "not marked override)")
        return text


def _parse(provider: str, name, value) -> tuple[str, bool]:
    if not isinstance(name, str) or not name:
        raise ModelRegistryError(f"{provider}: omniinfer_models() returned architecture name "
                                 f"{name!r}; names are non-empty strings")
    override = False
    if isinstance(value, dict):
        unknown = set(value) - {"class", "override"}
        if unknown or "class" not in value:
            raise ModelRegistryError(f"{provider}: omniinfer_models()[{name!r}]={value!r}; a dict "
                                     "value has the keys 'class' and (optionally) 'override'")
        value, override = value["class"], value.get("override", False)
        if not isinstance(override, bool):
            raise ModelRegistryError(f"{provider}: omniinfer_models()[{name!r}]['override']="
                                     f"{override!r}; allowed: True or False")
    if not isinstance(value, str) or value.count(":") != 1 or not all(value.split(":")):
        raise ModelRegistryError(f"{provider}: omniinfer_models()[{name!r}]={value!r}; a target "
                                 "is 'package.module:Class'")
    return value, override


def merge_models(models: dict[str, ModelEntry], provider: str, offered: dict) -> list[str]:
    """Add one provider's answer to `models`; returns the conflicts it caused, as messages."""
    if not isinstance(offered, dict):
        raise ModelRegistryError(f"{provider}: omniinfer_models() returned {type(offered).__name__}; "
                                 "it returns a dict {architecture: 'module:Class'}")
    conflicts = []
    for name, value in offered.items():
        target, override = _parse(provider, name, value)
        entry = models.get(name)
        if entry is None:
            models[name] = ModelEntry(name, target, provider)
        elif override:
            models[name] = ModelEntry(name, target, provider, entry.overrides + [entry.provider],
                                      entry.ignored)
            logger.info("architecture %s: %s overrides %s", name, provider, entry.provider)
        else:
            entry.ignored.append(provider)
            message = (f"architecture {name!r} is provided by {entry.provider!r} and {provider!r}; "
                       f"using {entry.provider!r} ({provider!r} does not mark it override)")
            logger.warning("%s", message)
            conflicts.append(message)
    return conflicts


def _models() -> dict[str, ModelEntry]:
    from omniinfer.platforms.registry import get_registry

    return get_registry().models


def supported_architectures() -> list[str]:
    return sorted(_models())


def model_class(architecture: str, config_path: str) -> type:
    entry = _models().get(architecture)
    if entry is None:
        raise ValueError(f"architecture {architecture!r} ({config_path}) is not supported; "
                         f"supported: {', '.join(supported_architectures())}")
    module, name = entry.target.split(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"architecture {architecture!r} ({config_path}): {entry.provider} names "
                         f"{entry.target!r}, which cannot be imported: {type(e).__name__}: {e}") from e
