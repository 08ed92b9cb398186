"""Random quantized checkpoints built independently of the loaders: for tests and benchmarks.

Weights are quantized by the published round-to-nearest rule (GPTQ's ``Quantizer``: per group
and output, ``scale = (max - min) / maxq`` over a range that includes 0, ``zero =
round(-min / scale)``, symmetric: the range is made symmetric and ``zero = (maxq + 1) / 2``),
with scales rounded to the checkpoint's dtype first so that the expected weight
``(code - zero) * scale`` is exact. The integer codes are then laid out in each format's
tensors by its documented bit layout (:mod:`omniinfer.quantization.int_packing`). The
expected weight comes from the codes, never from unpacking, so a loader that misreads a
layout disagrees with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniinfer.quantization.int_packing import natural_to_awq, pack_int32


@dataclass
class Quantized:
    codes: torch.Tensor  # int64 [out, in], unsigned codes
    scales: torch.Tensor  # [groups, out], the checkpoint's dtype
    zeros: torch.Tensor  # int64 [groups, out]
    g_idx: torch.Tensor  # int64 [in]
    expected: torch.Tensor  # float32 [out, in]: (code - zero) * scale


def rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool, act_order: bool = False,
        scale_dtype: torch.dtype = torch.float16, seed: int = 0) -> Quantized:
    """Quantize float `weight` [out, in] per group of `group_size` inputs (-1: one group);
    with `act_order`, groups are formed over a random permutation of the inputs (as GPTQ's
    desc_act does over the Hessian's order), which g_idx records."""
    out_features, in_features = weight.shape
    gl = in_features if group_size == -1 else group_size
    groups = -(-in_features // gl)
    order = torch.arange(in_features)
    if act_order:
        order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(in_features, dtype=torch.int64)
    g_idx[order] = torch.arange(in_features) // gl
    maxq = (1 << bits) - 1
    w = weight.float()
    codes = torch.empty(out_features, in_features, dtype=torch.int64)
    scales = torch.empty(groups, out_features, dtype=scale_dtype)
    zeros = torch.empty(groups, out_features, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        x = w[:, cols]
        xmin = x.min(1).values.clamp(max=0)
        xmax = x.max(1).values.clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        scale = ((xmax - xmin) / maxq).clamp(min=1e-5).to(scale_dtype)
        zero = (torch.full_like(xmin, (maxq + 1) // 2) if sym
                else torch.round(-xmin / scale.float()))
        q = torch.clamp(torch.round(x / scale.float()[:, None]) + zero[:, None], 0, maxq)
        codes[:, cols] = q.long()
        scales[g], zeros[g] = scale, zero.long()
    expected = (codes - zeros[g_idx].t()).float() * scales.float()[g_idx].t()
    return Quantized(codes, scales, zeros, g_idx, expected)


def gptq_tensors(q: Quantized, bits: int, v1: bool = True) -> dict[str, torch.Tensor]:
    """AutoGPTQ's tensors: qweight [in / P, out] packed along the input dim, qzeros [groups,
    out / P] along the output dim holding zero - 1 (v1) or the zero (v2)."""
    mask = (1 << bits) - 1
    stored = (q.zeros - 1) & mask if v1 else q.zeros
    return {"qweight": pack_int32(q.codes.t(), bits, 0), "qzeros": pack_int32(stored, bits, 1),
            "scales": q.scales, "g_idx": q.g_idx.to(torch.int32)}


def awq_tensors(q: Quantized) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors: qweight [in, out / 8] and qzeros [groups, out / 8], packed along
    the output dim with the columns of each word in AWQ_ORDER."""
    return {"qweight": pack_int32(natural_to_awq(q.codes.t()), 4, 1),
            "qzeros": pack_int32(natural_to_awq(q.zeros), 4, 1), "scales": q.scales}


def ct_packed_tensors(q: Quantized, bits: int, sym: bool, g_idx: bool = False
                      ) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: codes (signed + 2**(bits-1), which are the unsigned
    codes) packed along the input dim, zero points along the output dim."""
    out_features, in_features = q.codes.shape
    tensors = {"weight_packed": pack_int32(q.codes, bits, 1), "weight_scale": q.scales.t().contiguous(),
               "weight_shape": torch.tensor([out_features, in_features])}
    if not sym:
        tensors["weight_zero_point"] = pack_int32(q.zeros.t(), bits, 0)
    if g_idx:
        tensors["weight_g_idx"] = q.g_idx.to(torch.int32)
    return tensors


def ct_int8_tensors(weight: torch.Tensor, static_input_scale: float | None = None,
                    scale_dtype: torch.dtype = torch.bfloat16):
    """compressed-tensors int-quantized W8A8 tensors (symmetric, per output channel) and the
    expected float weight."""
    scale = (weight.float().abs().amax(1, keepdim=True) / 127).clamp(min=1e-8).to(scale_dtype)
    codes = torch.clamp(torch.round(weight.float() / scale.float()), -128, 127).to(torch.int8)
    tensors = {"weight": codes, "weight_scale": scale}
    if static_input_scale is not None:
        tensors["input_scale"] = torch.tensor([static_input_scale], dtype=torch.float32)
    return tensors, codes.float() * scale.float()


from omniinfer.quantization.fp8 import E4M3_MAX as FP8_MAX  # noqa: E402 (e4m3's largest finite value)


def fp8_tensors(weight: torch.Tensor, block: tuple[int, int] | None, strategy: str = "tensor",
                scale_name: str = "weight_scale_inv", scale_dtype: torch.dtype = torch.float32,
                static_input_scale: float | None = None):
    """FP8 (e4m3) tensors of `weight` as transformers' fine-grained FP8 and llm-compressor write
    them (a scale per `block` (bn, bk): its largest |w| / 448; else per output channel or per
    tensor), and the float32 weight they stand for (e4m3 value times scale)."""
    w = weight.float()
    rows, cols = w.shape
    if block is not None:
        bn, bk = block
        nr, nc = -(-rows // bn), -(-cols // bk)
        padded = torch.zeros(nr * bn, nc * bk)
        padded[:rows, :cols] = w.abs()
        amax = padded.reshape(nr, bn, nc, bk).amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
        full = scale.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)[:rows, :cols]
    elif strategy == "channel":
        scale = (w.abs().amax(1, keepdim=True) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
        full = scale.float().expand(rows, cols)
    else:
        scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12).to(scale_dtype).reshape(())
        full = scale.float().expand(rows, cols)
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    tensors = {"weight": q, scale_name: scale}
    if static_input_scale is not None:
        tensors["input_scale"] = torch.tensor(static_input_scale, dtype=torch.float32)
    return tensors, q.float() * full
