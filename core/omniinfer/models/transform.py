"""A platform's load-time changes to a model: the one declared model-transform hook.

`Platform.model_transform(config, attn_backend)` returns a `ModelTransform` (or None: the model
runs as loaded, on torch ops). The core runner calls it while it loads the model, in this order:

* `before_load()`: set-up the loading itself depends on (the CPU plugin's thread count);
* the model loads; `after_load(model)` sees it whole (what to pack fits in memory?);
* `linear_method(layer)` for every linear layer and the LM head (`models/layers/linear.py`):
  the layer's `LinearMethod`, or None for torch's `F.linear`; it then processes the loaded
  weights once;
* `moe_method(layer)` for every mixture-of-experts layer (`models/layers/moe.py`): its
  `MoEMethod` (a fused kernel), or None for the torch reference; it then processes the weights;
* `layer_ops()`: norm, rotary, SiLU-and-multiply and the greedy argmax (`LayerOps`), or None;
* `decoder_stack(layers)`: all decoder layers in one call (`DecoderStack`), or None;
* `after_install(model)`: the last word (the CPU plugin moves the weights to huge pages).

Whatever a transform makes (packed copies of weights, a compiled stack, their bookkeeping)
lives in the transform and in the objects it hands back, never in attributes it adds to the
core's modules: a layer keeps exactly its own parameters and the method it was given.
"""

from __future__ import annotations

from torch import nn

from omniinfer.models.layers.decoder_stack import DecoderLayerSpec, DecoderStack
from omniinfer.models.layers.layer_ops import LayerOps
from omniinfer.models.layers.linear import LinearMethod
from omniinfer.models.layers.moe import MoEMethod


class ModelTransform:
    # the optional parts of a DecoderLayerSpec (decoder_stack.OPTIONAL_PARTS) decoder_stack computes:
    # a model whose layers have others runs them one by one
    decoder_stack_parts: frozenset[str] = frozenset()

    def before_load(self) -> None:
        """Called before the model is built and its weights read."""

    def after_load(self, model: nn.Module) -> None:
        """Called with the loaded model, before anything is installed on it."""

    def linear_method(self, layer: nn.Module) -> LinearMethod | None:
        """This layer's `LinearMethod` (a fresh one per layer may hold that layer's copies)."""
        return None

    def moe_method(self, layer: nn.Module) -> MoEMethod | None:
        """This `FusedMoE` layer's `MoEMethod` (a fresh one per layer may hold its copies)."""
        return None

    def layer_ops(self) -> LayerOps | None:
        return None

    def decoder_stack(self, layers: list[DecoderLayerSpec]) -> DecoderStack | None:
        """Called once, after the linear methods and layer ops are installed."""
        return None

    def after_install(self, model: nn.Module) -> None:
        """Called last, with everything installed."""
