"""Every hook a device plugin can implement, in one place.

A plugin is a module (or object) registered under the entry-point group
``omniinfer.plugins``. It marks its functions with :data:`hookimpl`::

    from omniinfer.platforms.hookspec import hookimpl

    PLUGIN_API_VERSION = "2.0"

    @hookimpl
    def omniinfer_platforms():
        from omniinfer_acme.platform import AcmePlatform
        return [AcmePlatform]

Hooks are called once per process, after all plugins are loaded. They must be cheap:
import the plugin's heavy modules lazily inside the function, never create a device
context, never import a vendor library just to answer.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "omniinfer"
ENTRY_POINT_GROUP = "omniinfer.plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def omniinfer_platforms() -> list[type]:
    """The :class:`~omniinfer.platforms.interface.Platform` subclasses this plugin provides.

    Called once when the registry is built. Every plugin's result is collected (this is
    not a first-result hook). Return an empty list or ``None`` when the plugin provides no
    platform (for example a plugin that only adds an attention backend). Two platforms
    with the same ``name`` are an error reported at load, naming both plugins.
    """


@hookspec
def omniinfer_attention_backends() -> list[type]:
    """The :class:`~omniinfer.attention.backend.AttentionBackend` subclasses this plugin provides.

    Called once when the registry is built; every plugin's result is collected. A backend
    says which device types it runs on (``supported_device_types``); a platform uses it
    when the platform lists its ``name`` among its preferences, or when the user names it
    (``attention_backend=`` / ``OMNIINFER_ATTENTION_BACKEND``). This is how a third-party
    plugin adds a kernel library to an existing platform. ``None`` means none.
    """


@hookspec
def omniinfer_quantization_kernels() -> list[type]:
    """The :class:`~omniinfer.quantization.base.QuantKernel` subclasses this plugin provides: a
    platform's native products for quantised weights (GGUF block types, int8, ...).

    Called once when the registry is built; every plugin's result is collected, in plugin order.
    A quantised layer uses, per weight segment, the first kernel whose ``device_types`` holds
    the selected device's type and whose ``kinds`` holds the segment's format, and whose
    ``unavailable()`` is None; otherwise the core's reference (dequantise, then torch). ``None``
    means none.
    """


@hookspec
def omniinfer_models() -> dict[str, str | dict]:
    """The model architectures this plugin provides: {architecture name, as config.json's
    ``architectures`` spells it: "package.module:Class"}.

    Called once when the registry is built; every plugin's result is collected (the core's own
    models come first, through this same hook). The class is imported only when a checkpoint of
    that architecture is loaded, so answering costs nothing. A name another provider already
    gives is reported (``omniinfer env``, a warning) and the first provider keeps it, unless the
    value says it replaces it: ``{"class": "package.module:Class", "override": True}``. The class
    follows the model contract of ``omniinfer.models.llama.LlamaForCausalLM`` (constructor
    ``(ModelConfig, attention backend)``, ``forward``, ``compute_logits``, ``load_weights``...).
    ``None`` means none.
    """
