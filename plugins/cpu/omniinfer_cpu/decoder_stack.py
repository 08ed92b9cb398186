"""The CPU plugin's decoder stack: all of a model's decoder layers in one `omni_decoder_layers` call.

Layer by layer, a token of batch-1 decode calls ten kernels a layer from Python (norms, the
products, rotary, attention, SiLU-and-multiply), each behind a module call, a linear method's
checks and a ctypes call: ~4 ms of a ~30 ms bfloat16 token of the medium benchmark model, while
the memory bus idles. The stack makes the same kernel calls, in the same order, on the same
rows, from C: the result is bit for bit the layers' (tests/plugins/cpu/test_decoder_stack.py).

Built by the plugin's model transform (transform.py) when every layer is one this plugin computes
end to end (CPU_PAGED attention, the CPU linear method with its compiled kernel, the compiled
layer ops, one dtype); a step is served when
its rows go to the kernel (`kernel_rows`; the products read the weights' coded copies where
there are) or every product has a weight packed for `omni_gemm`.
Otherwise the model runs its layers as before. `OMNIINFER_CPU_DECODER_STACK=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os

import torch

from omniinfer.models.layers.decoder_stack import DecoderLayerSpec
from omniinfer_cpu.attention.paged import kernel_metadata
from omniinfer_cpu.layer_ops import CpuLayerOps
from omniinfer_cpu.linear import DTYPE_CODES, CpuLinearMethod

ENV_STACK = "OMNIINFER_CPU_DECODER_STACK"  # "0": the model runs its layers one by one (A/B runs)
POINTERS = ("input_norm", "qkv", "qkv_packed", "qkv_ec", "qkv_bias", "o", "o_packed", "o_ec", "o_bias",
            "post_norm", "gate_up", "gate_up_packed", "gate_up_ec", "gate_up_bias", "down", "down_packed",
            "down_ec", "down_bias", "k_cache", "v_cache", "cos", "sin")
SIZES = ("hidden", "num_heads", "num_kv_heads", "head_size", "intermediate", "block_size", "window",
         "max_position", "rotary_dim")


PRODUCTS = ("qkv", "o", "gate_up", "down")
EXPERT_POINTERS = ("router", "router_packed", "router_ec", "e_w13", "e_s13", "e_w2", "e_s2", "e_kind13", "e_kind2")
MAX_TOP_K = 64  # quant_moe.c's QMOE_MAX_K
EXPERT_SIZES = ("num_experts", "top_k", "renormalize", "expert_intermediate", "tokens_kind13", "tokens_kind2")
QSEGS = 3  # decoder_stack.c's: row ranges of several formats a quantised product may have


class Layer(ctypes.Structure):
    """decoder_stack.c's omni_layer."""
    _fields_ = ([(name, ctypes.c_void_p) for name in POINTERS]
                + [(name, ctypes.c_float) for name in ("input_eps", "post_eps", "scale")]
                + [(name, ctypes.c_int) for name in SIZES]
                + [(f"{p}_q", ctypes.c_void_p) for p in PRODUCTS]
                + [(f"{p}_qscale", ctypes.c_void_p) for p in PRODUCTS]
                + [(f"{p}_qkind", ctypes.c_int) for p in PRODUCTS]
                + [("qseg", (ctypes.c_void_p * QSEGS) * len(PRODUCTS)),
                   ("qseg_scale", (ctypes.c_void_p * QSEGS) * len(PRODUCTS)),
                   ("qseg_kind", (ctypes.c_int * QSEGS) * len(PRODUCTS)),
                   ("qseg_rows", (ctypes.c_int * QSEGS) * len(PRODUCTS)),
                   ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                   ("q_eps", ctypes.c_float), ("k_eps", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in EXPERT_POINTERS]
                + [(name, ctypes.c_int) for name in EXPERT_SIZES])


def quant_kernels(layer):
    """The CpuQuantKernels running a quantised layer's rows, in row order (one, or up to QSEGS
    where its parts are in several formats: q4_k_m's Q6_K v_proj beside Q4_K q and k), or None
    (not quantised, a part on the reference, or more parts)."""
    from omniinfer_cpu.quant import CpuQuantKernel

    kernels = getattr(layer, "quant_kernels", None)
    if getattr(layer, "qweight", None) is None or not kernels or len(kernels) > QSEGS:
        return None
    at = 0
    for row0, kernel in kernels:
        if not isinstance(kernel, CpuQuantKernel) or row0 != at:
            return None
        at += kernel.piece.shape[0]
    return [kernel for _, kernel in kernels] if at == layer.qweight.shape[0] else None


def _products(spec: DecoderLayerSpec):
    """The layer's products by decoder_stack.c's names (a sparse layer has no gate_up or down: its
    router is among `_linears`, its experts are the step's)."""
    products = {"qkv": spec.qkv_proj, "o": spec.o_proj, "gate_up": spec.gate_up_proj, "down": spec.down_proj}
    return {name: layer for name, layer in products.items() if layer is not None}


def _experts_unsupported(spec: DecoderLayerSpec, dtype: torch.dtype) -> str | None:
    """Why a sparse layer's router and experts are not ones decoder_stack.c runs, or None."""
    from omniinfer.quantization.experts import QuantMoEMethod
    from omniinfer_cpu.moe import CpuExpertsStep

    router, method = spec.router, spec.experts.moe_method
    if dtype != torch.float32:
        return f"a sparse layer in {dtype} (its experts' one-call step is float32)"
    if (getattr(router, "qweight", None) is not None or router.bias is not None
            or not isinstance(router.linear_method, CpuLinearMethod) or router.linear_method.linear is None):
        return "a router that is not a float product on the compiled kernel"
    if not isinstance(method, QuantMoEMethod) or not isinstance(method.step, CpuExpertsStep):
        return "experts that do not run on the CPU's quantised one-call step (float or reference experts)"
    if spec.experts.top_k > MAX_TOP_K:
        return f"{spec.experts.top_k} experts a token (omni_qmoe takes up to {MAX_TOP_K})"
    return None


def unsupported(kernels, specs: list[DecoderLayerSpec], attention: str) -> str | None:
    """Why these layers cannot be one stack, or None (`attention`: the backend's name)."""
    if os.environ.get(ENV_STACK, "1").strip() == "0":
        return f"switched off ({ENV_STACK}=0)"
    if kernels is None:
        return "the CPU kernels are unavailable"
    dtype = specs[0].qkv_proj.weight.dtype
    if dtype not in DTYPE_CODES:
        return f"dtype {dtype}"
    if attention != "CPU_PAGED":  # the stack calls CPU_PAGED's kernel on its cache layout
        return f"attention is {attention}, not CPU_PAGED"
    for spec in specs:
        ops = (spec.input_norm.ops, spec.post_norm.ops, spec.rotary.ops,
               *([spec.gate_up_proj.silu_and_mul.ops] if spec.experts is None else []))
        if not all(isinstance(op, CpuLayerOps) for op in ops):
            return "a layer op is not the compiled one"
        if spec.experts is not None and (why := _experts_unsupported(spec, dtype)):
            return why
        for layer in _products(spec).values():
            method = layer.linear_method
            if getattr(layer, "qweight", None) is not None:
                if quant_kernels(layer) is None:
                    return (f"a quantised layer does not run on CPU kernels (a part in a format the "
                            f"reference runs, or more than {QSEGS} parts)")
            elif not isinstance(method, CpuLinearMethod) or method.linear is None:
                return "a linear layer does not run the compiled kernel"
            if any(t is not None and t.dtype != dtype for t in (layer.weight, layer.bias)):
                return "the layers' tensors differ in dtype"
        norms = [spec.input_norm, spec.post_norm] + ([spec.q_norm, spec.k_norm] if spec.q_norm is not None else [])
        if any(not isinstance(n.ops, CpuLayerOps) for n in norms):
            return "a layer op is not the compiled one"
        if any(n.weight.dtype != dtype for n in norms):
            return "the layers' tensors differ in dtype"
        if spec.q_norm is not None and (spec.k_norm is None or any(
                n.weight.shape != (spec.attn.impl.head_size,) or not n.weight.is_contiguous()
                for n in (spec.q_norm, spec.k_norm))):
            return "its head norms are not one weight of the head size each for q and k"
        if spec.rotary.cos.dtype != torch.float32:
            return "the rotary table is not float32"
    if len({layer.linear_method.layer_kernel_rows for spec in specs for layer in _linears(spec)
            if isinstance(layer.linear_method, CpuLinearMethod)}) > 1:
        return "the linear layers differ in how many rows go to the kernel"
    return None


def _linears(spec: DecoderLayerSpec) -> list:
    return [*_products(spec).values(), *([spec.router] if spec.router is not None else [])]


class CpuDecoderStack:
    def __init__(self, kernels, specs: list[DecoderLayerSpec]):
        self.kernels = kernels
        self.specs = specs
        self.dtype = specs[0].qkv_proj.weight.dtype
        methods = [layer.linear_method for spec in specs for layer in _linears(spec)
                   if isinstance(layer.linear_method, CpuLinearMethod)]
        # quantised products run omni_qlinear at any row count
        self.kernel_rows = methods[0].layer_kernel_rows if methods else 1 << 30
        # more rows: omni_gemm, which needs every float product packed for it
        self.has_gemm = all(m.gemm_weight is not None for m in methods)
        s = specs[0]
        self.hidden = s.qkv_proj.weight.shape[1]
        inter = max((t.down_proj.weight.shape[1] for t in specs if t.down_proj is not None), default=0)
        self.inter = inter  # (the widest dense MLP: the work buffers are sized by it)
        # a chunk of tokens (a prefill) goes through the experts in one call where each sparse layer
        # is in groups of 8 with int8 activations (omni_qmoe_tokens), else one token at a time
        self.chunks = all(t.experts.moe_method.step.tokens_kinds for t in specs if t.experts is not None)
        # FP8 products of a bfloat16 model may take a prefill through torch's matmul on the weight
        # decoded (quant.py's fp8_prefill_rows): such a step runs layer by layer
        from omniinfer_cpu.quant import F8_CODE, fp8_prefill_rows

        fp8 = any(k.code == F8_CODE for spec in specs for layer in _products(spec).values()
                  for k in quant_kernels(layer) or ())
        self.max_tokens = fp8_prefill_rows(self.dtype) if fp8 else 1 << 30
        q_size = s.attn.num_heads * s.attn.head_size
        qkv_size = s.qkv_proj.weight.shape[0]
        # omni_decoder_layers' work (the last part: q and k normed per head, where there are head norms)
        self.work_per_row = self.hidden + qkv_size + q_size + 3 * inter + (q_size + qkv_size) // 2
        self.max_position = s.rotary.cos.shape[0]
        self.layers = None  # the structs, made at the first step: weights may move after loading
        self.cache_ptrs: list[int] = []

    def _make_layers(self):
        layers = (Layer * len(self.specs))()
        for struct, spec in zip(layers, self.specs):
            ptr = {"input_norm": spec.input_norm.weight, "post_norm": spec.post_norm.weight,
                   "cos": spec.rotary.cos, "sin": spec.rotary.sin}
            for name, layer in _products(spec).items():
                ptr[name + "_bias"] = layer.bias
                kernels = quant_kernels(layer)
                if kernels is not None:
                    ptr[name] = ptr[name + "_packed"] = ptr[name + "_ec"] = None
                    ptr[name + "_q"], ptr[name + "_qscale"] = kernels[0].w, kernels[0].scale
                    setattr(struct, name + "_qkind", kernels[0].code)
                    if len(kernels) > 1:  # row ranges, each its own format
                        p = PRODUCTS.index(name)
                        for i, k in enumerate(kernels):
                            assert k.w.is_contiguous() and (k.scale is None or k.scale.is_contiguous()), name
                            struct.qseg[p][i] = k.w.data_ptr()
                            struct.qseg_scale[p][i] = None if k.scale is None else k.scale.data_ptr()
                            struct.qseg_kind[p][i], struct.qseg_rows[p][i] = k.code, k.piece.shape[0]
                    continue
                ptr[name] = layer.weight
                ptr[name + "_packed"] = layer.linear_method.gemm_weight  # the method's copies
                ptr[name + "_ec"] = layer.linear_method.ec_weight
            for name, t in ptr.items():
                assert t is None or t.is_contiguous(), name
                setattr(struct, name, None if t is None else t.data_ptr())
            if spec.q_norm is not None:  # (contiguous: checked by unsupported())
                struct.q_norm, struct.k_norm = spec.q_norm.weight.data_ptr(), spec.k_norm.weight.data_ptr()
                struct.q_eps, struct.k_eps = spec.q_norm.eps, spec.k_norm.eps
            impl = spec.attn.impl
            struct.input_eps, struct.post_eps = spec.input_norm.eps, spec.post_norm.eps
            struct.scale = impl.scale
            struct.hidden, struct.num_heads, struct.num_kv_heads = self.hidden, impl.num_heads, impl.num_kv_heads
            struct.head_size = impl.head_size
            struct.intermediate = self.inter if spec.down_proj is None else spec.down_proj.weight.shape[1]
            if spec.experts is not None:
                self._point_at_experts(struct, spec)
            struct.window, struct.max_position = impl.sliding_window or 0, spec.rotary.cos.shape[0]
            struct.rotary_dim = 2 * spec.rotary.cos.shape[1]
        return layers

    def _point_at_experts(self, struct, spec: DecoderLayerSpec) -> None:
        step, method = spec.experts.moe_method.step, spec.router.linear_method
        if step.table is None:  # (the step's own tables, as its calls read them)
            step.table = step.addresses()
        w13, s13, k13, w2, s2, k2 = step.table
        for name, t in (("router", spec.router.weight), ("router_packed", method.gemm_weight),
                        ("router_ec", method.ec_weight), ("e_w13", w13), ("e_s13", s13), ("e_w2", w2),
                        ("e_s2", s2), ("e_kind13", k13), ("e_kind2", k2)):
            assert t is None or t.is_contiguous(), name
            setattr(struct, name, None if t is None else t.data_ptr())
        struct.num_experts, struct.top_k = len(step.w13), spec.experts.top_k
        struct.renormalize, struct.expert_intermediate = int(spec.experts.renormalize), step.intermediate
        struct.tokens_kind13, struct.tokens_kind2 = step.tokens_kinds or (0, 0)

    def _point_at(self, kv_caches: list[torch.Tensor]) -> bool:
        """Point the structs at these caches; False when one is not as CPU_PAGED allocates it."""
        ptrs = [c.data_ptr() for c in kv_caches]
        if ptrs == self.cache_ptrs:
            return True
        if any(c.dtype != self.dtype or c.dim() != 5 or not c.is_contiguous() for c in kv_caches):
            return False
        for struct, cache in zip(self.layers, kv_caches):
            struct.k_cache, struct.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
            struct.block_size = cache.shape[3]
        self.cache_ptrs = ptrs
        return True

    def __call__(self, positions, hidden_states, residual, kv_caches, attn_metadata):
        num_tokens = hidden_states.shape[0]
        if (num_tokens == 0 or (num_tokens > self.kernel_rows and not self.has_gemm)
                or (num_tokens > 1 and not self.chunks) or num_tokens > self.max_tokens
                or len(kv_caches) != len(self.specs) or hidden_states.dtype != self.dtype):
            return None
        if self.layers is None:
            self.layers = self._make_layers()
        if not self._point_at(kv_caches):
            return None
        slots, tables, qsl, seq_lens = kernel_metadata(attn_metadata)
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        hidden = torch.empty(num_tokens, self.hidden, dtype=self.dtype)
        hidden.copy_(hidden_states)
        new_residual = torch.empty_like(hidden)
        if residual is not None:
            new_residual.copy_(residual)
        work = torch.empty(num_tokens * self.work_per_row, dtype=self.dtype)
        result = self.kernels.decoder_layers(
            ctypes.addressof(self.layers), len(self.specs), hidden.data_ptr(), new_residual.data_ptr(),
            int(residual is not None), positions.data_ptr(), slots.data_ptr(), num_tokens,
            tables.data_ptr(), tables.stride(0), qsl.data_ptr(), seq_lens.data_ptr(),
            len(attn_metadata.seq_lens), work.data_ptr(), self.kernel_rows, DTYPE_CODES[self.dtype],
            torch.get_num_threads())
        if result == -3:
            raise IndexError(f"a position is outside the rotary table ({self.max_position} positions)")
        if result != 0:
            raise RuntimeError(f"omni_decoder_layers failed ({result})")
        return hidden, new_residual
