"""The kernel catalogue: every Triton launch the backends make, as data a check can enumerate.

A :class:`KernelLaunch` is one configuration of one op (the function a backend calls, such as
``paged_decode_attention``): a label, the shape it was derived from, and a callable that runs
the project's own launch code on ``meta`` tensors. Nothing is computed: the ahead-of-time check
(``python -m omniinfer.testing.kernels_aot``) records the ``kernel[grid](...)`` calls the launch
code makes and compiles each for the :data:`TARGETS`, so the constexprs, dtypes, strides and
options it compiles are the ones the launch code derives at run time, not a copy of them.

A kernel added later (quantised GEMM/GEMV, fused MoE, grammar masks) registers the same way: a
function returning its launches, appended to :data:`SOURCES`, and its op names to the refusal
table's vocabulary (:mod:`.refusals`); the quantized layers' functions live in
:mod:`.catalogue_quant`. ``tests/test_kernels_aot.py`` fails when a ``@triton.jit`` kernel in the
project is launched by no catalogued configuration.

Importing this module imports torch, not triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch

# the quantized layers' launches (catalogue_quant.py imports nothing of this module at import time)
from omniinfer.kernels.triton.catalogue_quant import fp8_launches, gguf_launches, quant_launches


@dataclass(frozen=True, slots=True)
class Target:
    """A compile target of the check and what its hardware allows one program (block)."""

    name: str  # "sm_90", "gfx942": what `Platform.device_arch()` reports for such a device
    backend: str  # triton's GPUTarget backend: "cuda" or "hip"
    arch: int | str  # GPUTarget arch: 90, "gfx942"
    warp_size: int
    platform: str  # the omniinfer platform that claims these devices
    max_shared_bytes: int  # shared memory (LDS) one block may use (opt-in maximum)
    max_registers: int  # per thread (NVIDIA) / per lane, VGPRs + AGPRs (AMD)
    example: str  # a device of this architecture
    optional: bool = False  # skipped, with a note, when the installed triton cannot target it
    is_device: bool = False  # the GPU present (numbers from its driver), not a catalogued target


TARGETS: tuple[Target, ...] = (
    Target("sm_80", "cuda", 80, 32, "cuda", 166912, 255, "A100"),
    Target("sm_90", "cuda", 90, 32, "cuda", 232448, 255, "H100"),
    Target("sm_100", "cuda", 100, 32, "cuda", 232448, 255, "B200", optional=True),
    Target("gfx90a", "hip", "gfx90a", 64, "rocm", 65536, 512, "MI250X"),
    Target("gfx942", "hip", "gfx942", 64, "rocm", 65536, 512, "MI300X"),
)


def target_for_arch(arch: str | None) -> Target | None:
    """The catalogued target whose compiled code a device of `arch` runs, if any: the same
    name, or for NVIDIA the same major version (sm_86 and sm_89 run what sm_80 compiles to)."""
    if not arch:
        return None
    for target in TARGETS:
        if target.name == arch:
            return target
    if arch.startswith("sm_") and arch[3:].isdigit():
        major = int(arch[3:]) // 10
        for target in TARGETS:
            if target.backend == "cuda" and int(target.arch) // 10 == major:
                return target
    return None


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """One layer's attention as a backend's `AttentionSpec` describes it (same field names, so
    a refusal's predicate reads either)."""

    model: str  # where the numbers come from
    dtype: torch.dtype
    num_heads: int  # on one rank
    num_kv_heads: int
    head_size: int
    block_size: int = 16  # CacheConfig's default
    sliding_window: int | None = None

    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.").replace("bfloat", "bf").replace("float", "fp")
        window = f" win{self.sliding_window}" if self.sliding_window else ""
        return (f"{dtype} {self.num_heads}/{self.num_kv_heads}x{self.head_size} "
                f"bs{self.block_size}{window} ({self.model})")


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    """One catalogued configuration of one op."""

    op: str  # the launch function a backend calls: "reshape_and_cache", "paged_decode_attention"
    config: str  # human label of the configuration, unique per op
    shape: object  # what refusals match on (an AttentionShape for the attention ops)
    launch: Callable[[], None]  # runs the launch code on meta tensors (the check records it)

    @property
    def name(self) -> str:
        return f"{self.op} {self.config}"


# ---- attention (kernels/triton/reshape_and_cache.py, paged_attention.py) -----------------------
# Per-rank attention geometries of the model families the engine serves (models/llama.py), at
# CacheConfig's default block size, in the dtypes the GPU platforms list. Kept tight (each
# compile costs about a second per target): each shape stresses one thing the others do not,
# and the write kernel (a masked copy of kv heads x head per token) comes with the common shape, the
# most heads (MHA) and the widest row (head 256 in float32).
# BLOCK_SIZE only enters index arithmetic, so block sizes other than 16 are left to the
# interpreted conformance tests (8/16/32).
_LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_size=128)  # also Mistral 7B, Llama 3 70B/TP8
_SHAPES: tuple[tuple[AttentionShape, tuple[str, ...]], ...] = (
    # the common case (GQA 4, half precision), and the smaller query tile of prompts and chunks
    # of 5-8 tokens (paged_prefill_attention shrinks BLOCK_Q to them; 1-4 tokens compile the
    # decode's tile)
    (AttentionShape("llama-3-8b", torch.bfloat16, **_LLAMA3_8B),
     ("write", "decode", "prefill", "prefill q8")),
    # multi-head attention: one query head per KV head (GROUP_PAD 1)
    (AttentionShape("llama-2-7b", torch.bfloat16, num_heads=32, num_kv_heads=32, head_size=128),
     ("write", "decode", "prefill")),
    # a group of 7 padded to 8, in float16 (what pre-bf16 GPUs and many ROCm users run)
    (AttentionShape("qwen2-7b", torch.float16, num_heads=28, num_kv_heads=4, head_size=128),
     ("decode", "prefill")),
    # float32 (TRITON and XFORMERS accept it): plain FMA dots instead of tensor cores
    (AttentionShape("llama-3-8b", torch.float32, **_LLAMA3_8B), ("prefill",)),
    # the largest head the TRITON backend accepts (MAX_HEAD_SIZE), in its widest dtype
    (AttentionShape("head-256 limit", torch.float32, num_heads=16, num_kv_heads=2, head_size=256),
     ("write", "decode", "prefill")),
    # a sliding window (a constexpr: each window size is its own kernel)
    (AttentionShape("mistral-7b-v0.1", torch.bfloat16, **_LLAMA3_8B, sliding_window=4096),
     ("prefill",)),
)
_LONG_CHUNK = 512  # tokens a prefill chunk has; "prefill qN" chunks have N


def _layer_tensors(shape: AttentionShape, num_tokens: int, num_seqs: int):
    """q (a view of the fused qkv projection, as the model passes it), out (as
    StagedAttentionImpl allocates it), the cache [2, blocks, block_size, kv heads, head] and
    the metadata fields the kernels read, all on the meta device."""
    heads, kv_heads, head = shape.num_heads, shape.num_kv_heads, shape.head_size
    meta = dict(device="meta")
    qkv = torch.empty(num_tokens, (heads + 2 * kv_heads) * head, dtype=shape.dtype, **meta)
    q, k, v = qkv.split([heads * head, kv_heads * head, kv_heads * head], dim=-1)
    q = q.view(num_tokens, heads, head)
    k = k.view(num_tokens, kv_heads, head)
    v = v.view(num_tokens, kv_heads, head)
    kv_cache = torch.empty(2, 64, shape.block_size, kv_heads, head, dtype=shape.dtype, **meta)
    md = SimpleNamespace(
        slot_mapping=torch.empty(num_tokens, dtype=torch.int64, **meta),
        block_tables=torch.empty(num_seqs, 64, dtype=torch.int32, **meta),
        seq_lens_tensor=torch.empty(num_seqs, dtype=torch.int32, **meta),
        query_start_loc=torch.empty(num_seqs + 1, dtype=torch.int32, **meta),
        max_query_len=num_tokens // num_seqs)
    return q, k, v, torch.empty_like(q), kv_cache, md


def _write(shape: AttentionShape) -> None:
    from omniinfer.attention.backends import triton as ops

    _, k, v, _, kv_cache, md = _layer_tensors(shape, 8, 8)
    ops.write_kv(k, v, kv_cache, md.slot_mapping)


def _decode(shape: AttentionShape) -> None:
    from omniinfer.attention.backends import triton as ops

    q, _, _, out, kv_cache, md = _layer_tensors(shape, 8, 8)
    ops.decode(out, q, kv_cache, md, shape.head_size ** -0.5, shape.sliding_window)


def _prefill(shape: AttentionShape, chunk: int) -> None:
    from omniinfer.attention.backends import triton as ops

    q, _, _, out, kv_cache, md = _layer_tensors(shape, 2 * chunk, 2)
    ops.prefill(out, q, kv_cache, md, shape.head_size ** -0.5, shape.sliding_window)


def attention_launches() -> list[KernelLaunch]:
    """What the attention backends launch through `attention/backends/triton.py`: the cache
    write, decode and prefill (FLASH_ATTN, XFORMERS and ROCM_FLASH call the same functions)."""
    launches = []
    for shape, stages in _SHAPES:
        for stage in stages:
            if stage == "write":  # the write kernel does not see query heads or windows
                dtype = shape.label().split()[0]
                launches.append(KernelLaunch(
                    "reshape_and_cache", f"{dtype} kv{shape.num_kv_heads}x{shape.head_size} "
                    f"bs{shape.block_size} ({shape.model})", shape, partial(_write, shape)))
            elif stage == "decode":
                launches.append(KernelLaunch("paged_decode_attention", shape.label(), shape,
                                             partial(_decode, shape)))
            else:
                chunk = int(stage.removeprefix("prefill q")) if " q" in stage else _LONG_CHUNK
                label = shape.label() + ("" if chunk == _LONG_CHUNK else f" q{chunk}")
                launches.append(KernelLaunch("paged_prefill_attention", label, shape,
                                             partial(_prefill, shape, chunk)))
    return launches


# ---- mixture of experts (kernels/triton/fused_moe.py) -------------------------------------------
@dataclass(frozen=True, slots=True)
class MoEShape:
    """One MoE layer on one rank (each expert's intermediate size already split)."""

    model: str
    dtype: torch.dtype
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int  # per rank
    num_tokens: int  # of the step: decode-sized steps take BLOCK_M 16, larger ones 64

    def label(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.").replace("bfloat", "bf").replace("float", "fp")
        return (f"{dtype} e{self.num_experts}k{self.top_k} {self.hidden_size}x{self.intermediate_size} "
                f"t{self.num_tokens} ({self.model})")


# Mixtral 8x7B at a decode step and a prefill chunk (BLOCK_M 16 / 64), Qwen3-30B-A3B's many small
# experts, and float32 (plain FMA dots). TOP_K, MUL_WEIGHT and the dtype are constexprs, so each
# shape compiles the kernel twice (gate/up, then down).
_MOE_SHAPES = (
    MoEShape("mixtral-8x7b", torch.bfloat16, 8, 2, 4096, 14336, 1),
    MoEShape("mixtral-8x7b", torch.bfloat16, 8, 2, 4096, 14336, 512),
    MoEShape("qwen3-30b-a3b", torch.float16, 128, 8, 2048, 768, 4),
    MoEShape("qwen2-moe tiny", torch.float32, 8, 4, 512, 256, 64),
)


def _fused_moe(shape: MoEShape) -> None:
    from omniinfer.kernels.triton import fused_moe as ops

    meta = dict(device="meta")
    e, k, h, i, t = (shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size,
                     shape.num_tokens)
    block_m = ops.block_m_for(t * k)
    capacity = -(-(t * k + e * (block_m - 1)) // block_m) * block_m
    ops.fused_moe_sorted(
        torch.empty(t, h, dtype=shape.dtype, **meta), torch.empty(e, 2 * i, h, dtype=shape.dtype, **meta),
        torch.empty(e, h, i, dtype=shape.dtype, **meta), torch.empty(t, k, dtype=torch.float32, **meta),
        torch.empty(capacity, dtype=torch.int32, **meta),
        torch.empty(capacity // block_m, dtype=torch.int32, **meta),
        torch.empty(1, dtype=torch.int32, **meta), k, block_m)


def moe_launches() -> list[KernelLaunch]:
    """What `TritonMoEMethod` launches through `fused_moe` (both grouped GEMMs of a layer)."""
    return [KernelLaunch("fused_moe", shape.label(), shape, partial(_fused_moe, shape))
            for shape in _MOE_SHAPES]


# Every source of catalogued launches; a new kernel family appends its function here.
SOURCES: tuple[Callable[[], list[KernelLaunch]], ...] = (attention_launches, quant_launches,
                                                          gguf_launches, fp8_launches, moe_launches)


def catalogue() -> list[KernelLaunch]:
    """Every catalogued launch, in a stable order."""
    return [launch for source in SOURCES for launch in source()]
