"""The CPU linear method: the compiled kernel for a row or two, packed weights above.

torch's `F.linear` on the checkpoint's [out, in] weight streams it at about half the memory
bandwidth for one row, and at a quarter for 2-16 rows (measured in docs/performance.md). So:

* up to `kernel_rows` rows (decode at batch 1-2): ``omni_linear``, which reads each weight row
  once, sequentially, at close to the machine's bandwidth;
* more rows, where the CPU has AVX-512 (float32) or AVX-512 BF16 (bfloat16): ``omni_gemm`` with
  the weight packed once, at load, for it (``omni_gemm_pack``): 1.1-1.6x oneDNN at 16-64 rows (a
  fixed cost of a few microseconds a call against oneDNN's 10-20), 0.9-1.1x at 256-2048. A merged
  gate_up layer built with `silu_and_mul` is packed so that the product writes silu(gate) * up
  itself, and an all-greedy step's LM head takes each row's greedy token as it multiplies
  (``omni_gemm_argmax``: no logits written, none read back; 3-16% off the LM head here);
* up to `kernel_rows` rows from a copy of the weight with coded top bytes made at load
  (``omni_ec_pack`` / ``omni_linear_ec``): the same values in 7/8 of float32's bytes or 3/4 of
  bfloat16's, the same sums bit for bit, for the decode that reads every weight once a token;
* the greedy token of one or two rows from an int8 copy of the LM head made at load
  (``omni_linear_argmax_q8``): every logit to within a proven bound, then exact sums, with
  ``omni_linear``'s arithmetic, for the few rows that could be the greatest; the same token as
  the argmax of ``omni_linear``'s logits from half (bfloat16) or a quarter (float32) of the bytes;
* more rows otherwise: oneDNN with the weight reordered once, at load, into its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``): 1.2-2x torch's `F.linear` at 9-2048 rows.

The packed copy costs the weight's bytes again (the [out, in] weight stays: the kernel and a
tied embedding read it), so it and the coded copy are made only while all the copies fit in a
quarter of the memory available at load (`OMNIINFER_CPU_PACK_WEIGHTS=0/1` forces it off/on);
without it the kernel serves up to `max_rows` rows and `F.linear` the rest.

Each layer gets its own `CpuLinearMethod`, which holds that layer's copies: the layer itself
keeps only its parameters (the model-transform contract, models/transform.py).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from omniinfer.logger import init_logger
from omniinfer.models.layers.embedding import ParallelLMHead
from omniinfer.models.layers.linear import LinearMethod

logger = init_logger(__name__)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
ENV_PACK = "OMNIINFER_CPU_PACK_WEIGHTS"
ENV_GEMM = "OMNIINFER_CPU_GEMM"  # "0": 3+ rows go to oneDNN's packed weights (A/B runs)
ENV_Q8 = "OMNIINFER_CPU_LM_HEAD_Q8"  # "0": no int8 copy of the LM head (A/B runs)
ENV_EC = "OMNIINFER_CPU_CODED_WEIGHTS"  # "0": no coded copies of the weights (A/B runs)
EC_MAX_PATCHES = 1 / 256  # a coded copy needing more patches than this share of weights is not made
EC_BITS = {torch.float32: 28, torch.bfloat16: 12}  # a coded copy's bits a weight
Q8_MAX_MISSES = 8  # consecutive calls with too many candidate rows before the copy is dropped
KERNEL_ROWS = 2  # the kernel beats oneDNN's packed weights up to here (fp32 and bf16)
MAX_ROWS = 16  # ... and torch's F.linear up to here
PACK_HINT_ROWS = 64  # the batch size oneDNN is told to expect (any size works)


def onednn_pack(weight: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """oneDNN's blocked copy of an [out, in] weight, or (None, why not)."""
    if not torch.backends.mkldnn.is_available():
        return None, "torch was built without oneDNN"
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None, "oneDNN has no bfloat16 support on this CPU"
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS), None
    except (RuntimeError, AttributeError) as e:
        return None, f"oneDNN could not reorder the weight ({e})"


_warned = False  # oneDNN's packing failed once: said once


class CpuLinearMethod(LinearMethod):
    """One layer's products, and that layer's copies of its weight (made by
    `process_weights_after_loading`: packed for omni_gemm or oneDNN, coded, int8)."""

    def __init__(self, kernels, pack: bool = False, max_rows: int = MAX_ROWS):
        self.linear = kernels.linear if kernels is not None else None
        self._kernels = kernels
        use_gemm = kernels is not None and os.environ.get(ENV_GEMM, "1").strip() != "0"
        self.gemm = kernels if use_gemm else None
        # the dtypes omni_gemm serves on this CPU (float32: AVX-512; bfloat16: AVX-512 BF16)
        self.gemm_dtypes = {d for d, code in DTYPE_CODES.items() if use_gemm and kernels.gemm_supported(code)}
        self.pack = pack
        self.max_rows = max_rows
        self.packed_weight = self.gemm_weight = self.ec_weight = None  # the layer's copies
        self.q8_weight = self.q8_scale = self.q8_coef = None  # the LM head's int8 copy
        self.q8_misses = 0
        self.gemm_gated = False  # a gate_up layer whose product is silu(gate) * up

    @property
    def kernel_rows(self) -> int:
        """Batches up to this many rows run the compiled kernel (with packed weights)."""
        return KERNEL_ROWS if self.pack else self.max_rows

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        global _warned
        if not layer.weight.is_contiguous():
            layer.weight.data = layer.weight.data.contiguous()
        self.packed_weight = self.gemm_weight = self.q8_weight = self.ec_weight = None
        if (self.pack and self.linear is not None and layer.weight.dtype in DTYPE_CODES
                and layer.weight.dim() == 2 and os.environ.get(ENV_EC, "1").strip() != "0"):
            self._ec_pack(layer)
        self.gemm_gated = getattr(layer, "silu_and_mul", None) is not None
        if (self.pack and self.linear is not None and isinstance(layer, ParallelLMHead) and layer.tp_size == 1
                and layer.weight.dtype in DTYPE_CODES and os.environ.get(ENV_Q8, "1").strip() != "0"):
            self._q8_pack(layer)
        if (self.pack and layer.weight.dtype in self.gemm_dtypes and layer.weight.dim() == 2
                and layer.weight.shape[1] % self.gemm.gemm_k_multiple(DTYPE_CODES[layer.weight.dtype]) == 0):
            self.gemm_weight = self._gemm_pack(layer.weight, self.gemm_gated)
        elif self.pack and layer.weight.dtype in DTYPE_CODES:
            self.packed_weight, why = onednn_pack(layer.weight)
            if why and not _warned:
                _warned = True
                logger.warning("linear layers use torch's F.linear above %d rows: %s", self.max_rows, why)

    @property
    def layer_kernel_rows(self) -> int:
        """Up to how many rows `apply` runs the layer on the compiled kernel: KERNEL_ROWS where a
        packed copy serves more rows, else max_rows."""
        return KERNEL_ROWS if self.packed_weight is not None or self.gemm_weight is not None else self.max_rows

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        rows = x.shape[0] if x.dim() == 2 else -1
        packed, gemm_weight = self.packed_weight, self.gemm_weight
        if (0 < rows <= self.layer_kernel_rows and self.linear is not None
                and x.dtype == weight.dtype in DTYPE_CODES):
            return self._kernel(layer, x, bias)
        if gemm_weight is not None and rows > 0 and x.dtype == weight.dtype and not self.gemm_gated:
            return self._gemm(layer, x, bias)
        if packed is not None and x.dtype == weight.dtype and rows > 0:
            if bias is not None and bias.dtype != x.dtype:
                bias = bias.to(x.dtype)
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, weight, bias)  # (a gated layer's plain product, which its model never asks)

    def apply_silu_and_mul(self, layer, x, bias, silu_and_mul):
        rows = x.shape[0] if x.dim() == 2 else -1
        if (self.gemm_weight is not None and self.gemm_gated
                and x.dtype == layer.weight.dtype and rows > 0):
            if rows > KERNEL_ROWS:
                return self._gemm(layer, x, bias)
            return silu_and_mul(self._kernel(layer, x, bias))
        return silu_and_mul(self.apply(layer, x, bias))

    def apply_argmax(self, layer, x, argmax_rows):
        rows = x.shape[0] if x.dim() == 2 else -1
        if (self.q8_weight is not None and 0 < rows <= KERNEL_ROWS
                and x.dtype == layer.weight.dtype):
            tokens = self._q8_argmax(layer, x)
            if tokens is not None:
                return tokens
        if (self.gemm_weight is not None and not self.gemm_gated
                and rows > KERNEL_ROWS and x.dtype == layer.weight.dtype):
            if x.stride(1) != 1:
                x = x.contiguous()
            num_out, num_in = layer.weight.shape
            tokens = torch.empty(rows, dtype=torch.int64)
            if self.gemm.gemm_argmax(x.data_ptr(), x.stride(0), self.gemm_weight.data_ptr(), None,
                                     tokens.data_ptr(), rows, num_out, num_in, DTYPE_CODES[x.dtype],
                                     torch.get_num_threads()) == 0:
                return tokens
        return super().apply_argmax(layer, x, argmax_rows)

    def _q8_pack(self, layer: torch.nn.Module) -> None:
        num_out, num_in = layer.weight.shape
        self.q8_weight = torch.empty(num_out, num_in, dtype=torch.int8)
        self.q8_scale = torch.empty(num_out, dtype=torch.float32)
        self.q8_coef = torch.empty(2 * num_out, dtype=torch.float32)
        self.q8_misses = 0
        self._kernels.q8_pack(layer.weight.data_ptr(), num_out, num_in, DTYPE_CODES[layer.weight.dtype],
                              self.q8_weight.data_ptr(), self.q8_scale.data_ptr(), self.q8_coef.data_ptr(),
                              torch.get_num_threads())

    def _ec_pack(self, layer: torch.nn.Module) -> None:
        """The coded copy of a weight, where this CPU decodes it (AVX-512 VBMI; bfloat16 also AVX-512
        BF16), the input width is a multiple of 16 (float32) or 32 (bfloat16) and few weights need
        patches."""
        num_out, num_in = layer.weight.shape
        threads, dtype = torch.get_num_threads(), DTYPE_CODES[layer.weight.dtype]
        patches = self._kernels.ec_count(layer.weight.data_ptr(), num_out, num_in, dtype, threads)
        if patches < 0 or patches > EC_MAX_PATCHES * num_out * num_in:
            return
        copy = torch.empty(self._kernels.ec_size(num_out, num_in, dtype, patches), dtype=torch.uint8)
        if self._kernels.ec_pack(layer.weight.data_ptr(), num_out, num_in, dtype, patches, copy.data_ptr(),
                                 threads) == 0:
            self.ec_weight = copy

    def _q8_argmax(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The rows' greedy tokens through the int8 copy, or None (a non-finite input, or too
        many rows near the top: the caller takes the logits)."""
        if x.stride(1) != 1:
            x = x.contiguous()
        num_out, num_in = layer.weight.shape
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        result = self._kernels.linear_argmax_q8(
            x.data_ptr(), x.stride(0), layer.weight.data_ptr(), self.q8_weight.data_ptr(),
            self.q8_scale.data_ptr(), self.q8_coef.data_ptr(), tokens.data_ptr(), x.shape[0], num_out,
            num_in, DTYPE_CODES[x.dtype], max(64, num_out // 32), torch.get_num_threads())
        if result == 0:
            self.q8_misses = 0
            return tokens
        if result == -2:  # logits too close together for the bound to pick: a flat model
            self.q8_misses += 1
            if self.q8_misses >= Q8_MAX_MISSES:
                logger.info("LM head: the int8 copy left too many candidate rows %d times in a row; "
                            "dropped", Q8_MAX_MISSES)
                self.q8_weight = None
        return None

    def _gemm_pack(self, weight: torch.Tensor, gated: bool) -> torch.Tensor:
        num_out, num_in = weight.shape
        out = torch.empty(self.gemm.gemm_packed_size(num_out, num_in, int(gated)), dtype=weight.dtype)
        self.gemm.gemm_pack(weight.data_ptr(), num_out, num_in, int(gated), DTYPE_CODES[weight.dtype],
                            out.data_ptr(), torch.get_num_threads())
        return out

    def _gemm(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.stride(1) != 1:
            x = x.contiguous()
        num_out, num_in = layer.weight.shape
        out = torch.empty(x.shape[0], num_out // 2 if self.gemm_gated else num_out, dtype=x.dtype)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        self.gemm.gemm(x.data_ptr(), x.stride(0), self.gemm_weight.data_ptr(),
                       None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
                       x.shape[0], num_out, num_in, int(self.gemm_gated), DTYPE_CODES[x.dtype],
                       torch.get_num_threads())
        return out

    def _kernel(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """omni_linear, or omni_linear_ec on the coded copy (the same result)."""
        if x.stride(1) != 1:
            x = x.contiguous()
        weight, coded = layer.weight, self.ec_weight
        rows, num_out = x.shape[0], weight.shape[0]
        out = torch.empty(rows, num_out, dtype=x.dtype)
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        bias_ptr = None if bias is None else bias.data_ptr()
        if coded is None or self._kernels.linear_ec(x.data_ptr(), x.stride(0), coded.data_ptr(), bias_ptr,
                                                    out.data_ptr(), num_out, rows, num_out, x.shape[1],
                                                    DTYPE_CODES[x.dtype], torch.get_num_threads()) != 0:
            self.linear(x.data_ptr(), x.stride(0), weight.data_ptr(), bias_ptr, out.data_ptr(), num_out,
                        rows, num_out, x.shape[1], DTYPE_CODES[x.dtype], torch.get_num_threads())
        return out


def should_pack(model: torch.nn.Module, available_bytes: int) -> bool:
    """OMNIINFER_CPU_PACK_WEIGHTS=0/1, else whether a second copy of every linear weight (and their
    coded copies, and the LM head's int8 copy) fits in a quarter of `available_bytes`."""
    setting = os.environ.get(ENV_PACK, "auto").strip().lower()
    if setting in ("0", "1"):
        return setting == "1"
    if setting != "auto":
        raise ValueError(f"{ENV_PACK}={setting!r}: expected 0, 1 or auto")
    weights = {id(m.weight): m.weight for m in model.modules() if hasattr(m, "linear_method")}
    extra = sum(w.numel() * w.element_size() for w in weights.values())
    extra += sum(w.numel() * EC_BITS.get(w.dtype, 0) // 8 for w in weights.values())
    extra += sum(m.weight.numel() for m in model.modules() if isinstance(m, ParallelLMHead))  # int8
    return extra <= available_bytes // 4
