"""Plugin discovery, platform detection and selection.

Every plugin, in-tree or third-party, is found the same way: an entry point in the group
``omniinfer.plugins`` whose object (usually a module) carries ``@hookimpl`` functions and a
``PLUGIN_API_VERSION``. The core holds no list of plugins.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import traceback
import warnings
from dataclasses import dataclass, field
from functools import cache

import pluggy

from omniinfer.logger import init_logger
from omniinfer.platforms import hookspec
from omniinfer.platforms.interface import Availability, Platform
from omniinfer.version import PLUGIN_API_VERSION, __version__

logger = init_logger(__name__)

ENV_PLUGINS = "OMNIINFER_PLUGINS"
ENV_DEVICE = "OMNIINFER_DEVICE"


@dataclass(slots=True)
class PluginRecord:
    """What happened to one entry point (shown by `omniinfer env` and in errors)."""

    name: str
    distribution: str
    version: str
    value: str  # the entry point's target, "module:attr"
    is_loaded: bool = False
    error: str = ""  # one line: why it was set aside
    details: str = ""  # the traceback, for --verbose reports
    platform_names: list[str] = field(default_factory=list)
    backend_names: list[str] = field(default_factory=list)
    model_names: list[str] = field(default_factory=list)  # architectures it offers
    is_adapted: bool = False  # written for the plugin API before this one: runs through an adapter
    warning: str = ""  # the deprecation warning it got then

    def label(self) -> str:
        return f"{self.name} ({self.distribution} {self.version})"


class PluginError(ValueError):
    """A plugin-layer mistake the user must fix (bad override, unknown plugin...)."""


def api_verdict(declared: str) -> str | None:
    """"native" (the major this core speaks), "adapted" (the major before, while this core's
    minor is 0: it runs through platforms/legacy.py), or None (refused)."""
    major, minor = (int(p) for p in PLUGIN_API_VERSION.split(".")[:2])
    try:
        theirs = int(str(declared).split(".")[0])
    except ValueError:
        return None
    if theirs == major:
        return "native"
    return "adapted" if theirs == major - 1 and minor == 0 else None


class PluginRegistry:
    """Loads plugins once and answers: which platforms and backends exist, which is chosen."""

    def __init__(self, entry_points: list[md.EntryPoint] | None = None, only: str | None = None):
        self.pm = pluggy.PluginManager(hookspec.PROJECT_NAME)
        self.pm.add_hookspecs(hookspec)
        self.records: list[PluginRecord] = []
        self.platforms: dict[str, type[Platform]] = {}
        self.backends: dict[str, type] = {}
        self.quant_kernels: list[type] = []  # (omniinfer.quantization.base.QuantKernel)
        self.models: dict = {}  # architecture -> omniinfer.models.registry.ModelEntry
        self.model_conflicts: list[str] = []  # two providers of one architecture, neither overriding
        eps = list(md.entry_points(group=hookspec.ENTRY_POINT_GROUP)) if entry_points is None else entry_points
        self._load(eps, os.environ.get(ENV_PLUGINS, "") if only is None else only)
        self._collect()

    # ---- loading -------------------------------------------------------------------------
    def _load(self, eps: list[md.EntryPoint], only: str) -> None:
        wanted = [n.strip() for n in only.split(",") if n.strip()]
        names = sorted({ep.name for ep in eps})
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise PluginError(
                f"{ENV_PLUGINS}={only!r} names plugin(s) {', '.join(map(repr, unknown))} that are "
                f"not installed; installed plugins: {', '.join(names) or 'none'}"
            )
        for ep in sorted(eps, key=lambda e: e.name):
            if wanted and ep.name not in wanted:
                continue
            dist = getattr(ep, "dist", None)
            record = PluginRecord(
                name=ep.name,
                distribution=dist.metadata["Name"] if dist is not None else "?",
                version=dist.version if dist is not None else "?",
                value=ep.value,
            )
            self.records.append(record)
            try:
                plugin = ep.load()
            except Exception as e:  # a broken plugin must not take the others down
                self._fail(record, f"failed to import {ep.value}: {type(e).__name__}: {e}", e)
                continue
            declared = getattr(plugin, "PLUGIN_API_VERSION", None)
            if declared is None:
                self._fail(record, f"{ep.value} does not declare PLUGIN_API_VERSION "
                                   f"(this omniinfer speaks plugin API {PLUGIN_API_VERSION})")
                continue
            verdict = api_verdict(declared)
            if verdict is None:
                major = PLUGIN_API_VERSION.split(".")[0]
                self._fail(record, f"written for plugin API {declared}, but omniinfer {__version__} "
                                   f"speaks plugin API {PLUGIN_API_VERSION}; install a release of "
                                   f"{record.distribution} made for plugin API {major}.x")
                continue
            record.is_adapted = verdict == "adapted"
            if record.is_adapted:
                self._deprecated(record, declared)
            try:
                self.pm.register(plugin, name=ep.name)
            except Exception as e:
                self._fail(record, f"failed to register: {type(e).__name__}: {e}", e)
                continue
            record.is_loaded = True

    def _deprecated(self, record: PluginRecord, declared: str) -> None:
        from omniinfer.platforms.legacy import WHAT_TO_CHANGE

        major, minor = PLUGIN_API_VERSION.split(".")[:2]
        message = (f"plugin {record.label()} is written for plugin API {declared}; omniinfer "
                   f"{__version__} speaks plugin API {PLUGIN_API_VERSION} and runs it through an "
                   f"adapter, which plugin API {major}.{int(minor) + 1} removes. To move to "
                   f"{PLUGIN_API_VERSION}: {WHAT_TO_CHANGE}")
        record.warning = message
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        logger.warning("%s", message)

    def _fail(self, record: PluginRecord, message: str, error: Exception | None = None) -> None:
        record.error = message
        record.details = "".join(traceback.format_exception(error)) if error is not None else ""
        logger.warning("plugin %s set aside: %s", record.label(), message)

    def _call(self, record: PluginRecord, hook: str) -> list[type]:
        plugin = self.pm.get_plugin(record.name)
        impl = getattr(plugin, hook, None)
        if impl is None:
            return []
        try:
            return list(impl() or [])
        except Exception as e:
            self.pm.unregister(plugin)
            record.is_loaded = False
            self._fail(record, f"hook {hook}() raised {type(e).__name__}: {e}", e)
            return []

    def _call_models(self, record: PluginRecord) -> dict:
        from omniinfer.models.registry import _parse

        plugin = self.pm.get_plugin(record.name)
        impl = getattr(plugin, "omniinfer_models", None)
        try:
            offered = (impl() or {}) if impl is not None else {}
            if not isinstance(offered, dict):
                raise TypeError(f"returned {type(offered).__name__}, not a dict "
                                "{architecture: 'module:Class'}")
            for name, value in offered.items():
                _parse(record.distribution, name, value)
        except Exception as e:
            self.pm.unregister(plugin)
            record.is_loaded = False
            self._fail(record, f"hook omniinfer_models() {type(e).__name__}: {e}", e)
            return {}
        return offered

    def _collect(self) -> None:
        from omniinfer.attention import builtin_backends
        from omniinfer.models import builtin as builtin_models
        from omniinfer.models.registry import CORE_PROVIDER, merge_models

        for cls in builtin_backends.core_backends():
            self.backends[cls.name] = cls
        self.model_conflicts += merge_models(self.models, CORE_PROVIDER, builtin_models.omniinfer_models())
        for record in self.records:
            if not record.is_loaded:
                continue
            platforms = self._call(record, "omniinfer_platforms")
            backends = self._call(record, "omniinfer_attention_backends") if record.is_loaded else []
            quant = self._call(record, "omniinfer_quantization_kernels") if record.is_loaded else []
            models = self._call_models(record) if record.is_loaded else {}
            if not record.is_loaded:  # a hook raised: none of what this plugin offered is used
                continue
            self.model_conflicts += merge_models(self.models, record.distribution, models)
            record.model_names = sorted(models)
            self.quant_kernels.extend(quant)
            for cls in platforms:
                if cls.name in self.platforms:
                    other = self.platforms[cls.name].plugin_name
                    raise PluginError(f"platform {cls.name!r} is provided by two plugins: "
                                      f"{other!r} and {record.distribution!r}; uninstall one")
                cls.plugin_name, cls.plugin_version = record.distribution, record.version
                self.platforms[cls.name] = cls
                record.platform_names.append(cls.name)
            if record.is_adapted:
                from omniinfer.platforms.legacy import adapt_backend

                backends = [adapt_backend(cls) for cls in backends]
            for cls in backends:
                if cls.name in self.backends:
                    raise PluginError(f"attention backend {cls.name!r} from {record.distribution!r} "
                                      "has the name of one already installed; a plugin adds backends "
                                      "under new names")
                self.backends[cls.name] = cls
                record.backend_names.append(cls.name)

    # ---- detection and selection -----------------------------------------------------------
    def availability(self) -> dict[str, Availability]:
        out = {}
        for name, cls in self.platforms.items():
            try:
                out[name] = cls.is_available()
            except Exception as e:
                out[name] = Availability(False, f"detection raised {type(e).__name__}: {e}")
        return out

    def failed(self) -> list[PluginRecord]:
        return [r for r in self.records if not r.is_loaded]

    def report(self) -> str:
        """Every installed platform with its verdict, and the plugins that failed."""
        lines = ["installed platforms:"]
        verdicts = self.availability()
        if not verdicts:
            lines.append("  (none)")
        for name, verdict in sorted(verdicts.items()):
            state = "available" if verdict else "unavailable"
            lines.append(f"  {name}: {state} - {verdict.reason} "
                         f"[plugin {self.platforms[name].plugin_name} {self.platforms[name].plugin_version}]")
        for record in self.failed():
            lines.append(f"  plugin {record.label()} failed to load: {record.error}")
        return "\n".join(lines)

    def select_platform(self, name: str | None = None) -> type[Platform]:
        """The named platform (argument, else ``OMNIINFER_DEVICE``), else the best available."""
        source = "device="
        if not name:
            name, source = os.environ.get(ENV_DEVICE) or None, f"{ENV_DEVICE}="
        verdicts = self.availability()
        if name:
            name = name.strip().lower()
            if name not in self.platforms:
                raise PluginError(f"{source}{name!r} names a platform that is not installed "
                                  f"(install the omniinfer-{name} plugin?)\n{self.report()}")
            if not verdicts[name]:
                raise PluginError(f"{source}{name!r} is installed but not available here: "
                                  f"{verdicts[name].reason}\n{self.report()}")
            chosen = self.platforms[name]
        else:
            candidates = [self.platforms[n] for n, v in verdicts.items() if v]
            if not candidates:
                raise PluginError(f"no available platform; install omniinfer-cpu at least\n{self.report()}")
            chosen = max(candidates, key=lambda c: c.priority)
        for other, verdict in verdicts.items():
            if other != chosen.name:
                logger.debug("platform %s not selected: %s", other, verdict.reason)
        return chosen


@cache
def get_registry() -> PluginRegistry:
    """The process-wide registry, built on first use."""
    return PluginRegistry()


def reset_registry() -> None:
    """Forget the loaded plugins (tests; after installing a plugin at run time)."""
    get_registry.cache_clear()


def select_platform(name: str | None = None) -> type[Platform]:
    return get_registry().select_platform(name)
