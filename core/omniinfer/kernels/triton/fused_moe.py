"""A mixture-of-experts layer's routed experts in Triton: a grouped GEMM over tokens sorted by
expert (vLLM's fused-MoE layout).

`moe_align_block_size` sorts the step's (token, k) pairs by expert and pads each expert's run to
a multiple of BLOCK_M, so every BLOCK_M rows of the sorted list belong to one expert; a program
of `_grouped_gemm_kernel` takes one such block and BLOCK_N output columns, and multiplies the
rows it gathers by that expert's weight tile by tile. Two launches a layer: [gate; up] from the
hidden states, then, after SiLU-and-multiply, the down projection scaled by each pair's routing
weight; the k results of a token are summed last. A decode step reads only its routed experts;
blocks past the padded length return at once.

Written for NVIDIA, AMD and Intel Triton back ends and the CPU interpreter (tests): plain masked
loads, ``tl.dot`` on tiles of at least 16, float32 accumulation, no vendor intrinsics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

INTERPRETED = bool(triton.knobs.runtime.interpret)  # fixed when the kernel below is defined
# (the interpreter multiplies bfloat16 dot operands as raw storage: interpreted dots are float32)
BLOCK_N, BLOCK_K = 64, 32


def block_m_for(num_pairs: int) -> int:
    """Rows a program takes: 16 for decode-sized steps (little padding per expert), 64 above."""
    return 16 if num_pairs <= 64 else 64


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, weights_ptr,
    N, K, num_pairs,
    stride_am, stride_we, stride_wn, stride_om,
    TOP_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_F32: tl.constexpr, ROUND_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair, n] = (a[pair // TOP_K] @ w[expert(pair)]^T)[n] (x weights[pair] when
    MUL_WEIGHT) for the pairs of one sorted block; pad entries (== num_pairs) are skipped."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + rows)
    pair_ok = pair < num_pairs
    a_rows = (pair // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + (k0 + ks)[None, :],
                    mask=pair_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if DOT_F32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision="ieee")
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pair, mask=pair_ok, other=0.0).to(tl.float32)[:, None]
    if ROUND_BF16:  # the interpreter truncates float32 -> bfloat16: round to nearest even first
        bits = acc.to(tl.uint32, bitcast=True)
        acc = (bits + 0x7FFF + ((bits >> 16) & 1)).to(tl.float32, bitcast=True)
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=pair_ok[:, None] & col_ok[None, :])


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_expert, num_padded) for [T, top_k] expert ids, with no host sync.

    sorted_ids [capacity] int32: the flat (token * top_k + k) pair indices grouped by expert in
    increasing order (pairs in order within an expert), each expert's run padded with
    `T * top_k` to a multiple of `block_m`; block_expert [capacity / block_m] int32: the expert
    of each block of `block_m` entries (num_experts past the end); num_padded [1] int32: the
    used length. capacity = T * top_k + num_experts * (block_m - 1), rounded up to block_m."""
    flat = topk_ids.flatten().to(torch.int64)
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    position = (ends - padded)[expert_of] + torch.arange(num_pairs, device=flat.device) - first_of_expert[expert_of]
    capacity = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[position] = order.to(torch.int32)
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(ends, block_start, right=True).to(torch.int32)
    return sorted_ids, block_expert, ends[-1:].to(torch.int32)


def _grouped_gemm(a, w, out, sorted_ids, block_expert, num_padded, weights, top_k, block_m):
    num_pairs = out.shape[0]
    n, k = w.shape[1], w.shape[2]
    grid = (block_expert.shape[0], triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_ids, block_expert, num_padded, weights if weights is not None else out,
        n, k, num_pairs, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, MUL_WEIGHT=weights is not None,
        DOT_F32=INTERPRETED or a.dtype == torch.float32,
        ROUND_BF16=INTERPRETED and out.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted sum [T, H] of x [T, H] (w13 [E, 2I, H], w2 [E, H, I],
    contiguous; one dtype), as `omniinfer.models.layers.moe.reference_moe`."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    if num_tokens == 0:
        return torch.zeros_like(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_m = block_m_for(num_tokens * top_k)
    sorted_ids, block_expert, num_padded = moe_align_block_size(topk_ids, block_m, num_experts)
    return fused_moe_sorted(x, w13, w2, topk_weights, sorted_ids, block_expert, num_padded, top_k,
                            block_m)


def fused_moe_sorted(x, w13, w2, topk_weights, sorted_ids, block_expert, num_padded, top_k: int,
                     block_m: int) -> torch.Tensor:
    """`fused_moe` after the sort (`moe_align_block_size(topk_ids, block_m, ...)`'s outputs):
    the two grouped GEMMs and SiLU-and-multiply between them (the kernel catalogue calls this)."""
    num_tokens, hidden = x.shape
    two_i = w13.shape[1]
    gate_up = torch.empty(num_tokens * top_k, two_i, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_ids, block_expert, num_padded, None, top_k, block_m)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    down = torch.empty(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.to(torch.float32).flatten().contiguous()
    _grouped_gemm(act, w2, down, sorted_ids, block_expert, num_padded, weights, 1, block_m)
    return down.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
