"""Plugin API 1.x, adapted for one minor version (2.0; plugin API 2.1 refuses it).

What 1.x had and 2.0 replaced, and how a 1.x plugin keeps working meanwhile:

* a metadata builder saw the batch one sequence at a time (``add_seq(...)``, ``add_decodes``,
  then ``build()``): `LegacyBuilderAdapter` drives it from the step's common description, one
  ``add_seq`` per sequence (2.0: one ``build(common)``);
* metadata advanced itself for drafting and multi-step decoding (``next_decode_step``,
  ``decode_step_fields``, ``advance_step``, ``clone``): no longer called; the core advances the
  common description and builds again, which a 1.x builder gets right by construction;
* a platform's ModelRunner subclass changed the model (``linear_method``, ``layer_ops``,
  ``decoder_stack``) or captured graphs (``GraphRunnerMixin.capture_graph``): the core runner
  still calls them (`RunnerHooksTransform`, worker/graph_runner.py), in place of
  `Platform.model_transform` and `Platform.supports_graph_capture`.

A platform check written into ``extra_reasons`` still works; 2.0 has ``supported_platforms``.
"""

from __future__ import annotations

import inspect
from typing import ClassVar

from omniinfer.attention.backend import AttentionMetadataBuilder
from omniinfer.attention.common import CommonAttentionMetadata
from omniinfer.models.transform import ModelTransform

WHAT_TO_CHANGE = (
    "declare PLUGIN_API_VERSION = \"2.0\" after: giving each attention backend's metadata builder "
    "one build(common: CommonAttentionMetadata) in place of add_seq/add_decodes/build() (and "
    "dropping its metadata's next_decode_step/decode_step_fields/advance_step: the core advances "
    "the common description); naming the platforms a backend serves in supported_platforms; "
    "replacing a ModelRunner subclass with Platform.model_transform() (its linear_method, "
    "layer_ops, decoder_stack) and Platform.supports_graph_capture (its capture_graph) "
    "(docs/conformance.md says what a platform and a backend implement)")


def is_legacy_builder(cls: type) -> bool:
    """A plugin API 1.x builder: `add_seq` per sequence, then `build()` with no argument."""
    if hasattr(cls, "add_seq"):
        return True
    try:
        return len(inspect.signature(cls.build).parameters) < 2
    except (TypeError, ValueError):
        return False


class LegacyBuilderAdapter(AttentionMetadataBuilder):
    """Runs a 1.x builder (`legacy_cls`) on the common description (deprecated)."""

    legacy_cls: ClassVar[type]

    def build(self, common: CommonAttentionMetadata):
        old = self.legacy_cls(self.block_size, self.sliding_window)
        tables = common.block_table.tolist()  # (1.x builders took lists: a host copy)
        bs = common.block_size
        for i, (seq_len, q) in enumerate(zip(common.seq_lens_host, common.query_lens_host)):
            old.add_seq(context_len=seq_len - q, query_len=q, block_table=tables[i][:max(1, -(-seq_len // bs))],
                        is_prefill=i < common.num_prefills)
        return old.build()


def adapt_backend(cls: type) -> type:
    """The backend itself when its builder speaks 2.0; else a subclass whose builder is the
    1.x one behind `LegacyBuilderAdapter`."""
    builder = cls.get_builder_cls()
    if not is_legacy_builder(builder):
        return cls
    adapter = type(f"{builder.__name__}Adapter", (LegacyBuilderAdapter,),
                   {"legacy_cls": builder, "metadata_cls": builder.metadata_cls})
    return type(cls.__name__, (cls,), {"get_builder_cls": classmethod(lambda c: adapter),
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                       "__doc__": cls.__doc__})


class RunnerHooksTransform(ModelTransform):
    """A 1.x runner subclass's `linear_method` / `layer_ops` / `decoder_stack`, as a transform."""

    HOOKS = ("linear_method", "layer_ops", "decoder_stack")

    def __init__(self, runner):
        self.runner = runner

    @classmethod
    def wanted(cls, runner) -> bool:
        return any(hasattr(runner, name) for name in cls.HOOKS)

    def linear_method(self, layer):
        return self.runner.linear_method(layer) if hasattr(self.runner, "linear_method") else None

    def layer_ops(self):
        return self.runner.layer_ops() if hasattr(self.runner, "layer_ops") else None

    def decoder_stack(self, layers):
        return self.runner.decoder_stack(layers) if hasattr(self.runner, "decoder_stack") else None
