"""The CUDA plugin's backends with no GPU: selection with the device simulated, the metadata
builders' tensors checked by hand, and contract tests (``test_contract_*``) that run the
forward paths against pure-torch stand-ins of flash-attn and xformers."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from omniinfer.attention.backend import AttentionSpec, PrefillKeySlotsMetadataBuilder
from omniinfer.attention.common import common_for
from omniinfer.attention.selector import select_attention_backend
from omniinfer.platforms.registry import PluginRegistry
from omniinfer.testing.conformance.cases import Case, assert_matches_reference, run_case
from omniinfer.worker.model_runner import ModelRunner
from omniinfer_cuda.attention.flash_attn import FlashAttentionBackend, FlashAttentionMetadataBuilder
from omniinfer_cuda.attention.xformers import XFormersBackend, prefill_bias
from omniinfer_cuda.platform import CudaPlatform

MIXED = ((0, 9), (13, 6), (32, 1), (5, 1), (17, 1))
CHUNKED = ((16, 16), (24, 5), (31, 2), (48, 1))


@pytest.fixture
def registry():
    return PluginRegistry(only="cpu,cuda,rocm,xpu")


@pytest.fixture
def gpu(monkeypatch):
    """gpu(capability) simulates one NVIDIA GPU of that compute capability."""

    def apply(capability=(9, 0)):
        monkeypatch.setattr(torch.version, "cuda", "12.4")
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=0: capability)

    return apply


@pytest.fixture
def triton_compiles(monkeypatch):
    """The core Triton kernels count as available on GPUs (here they only run interpreted)."""
    monkeypatch.setattr("omniinfer.kernels.triton.unavailable_reasons",
                        lambda device_type: [])


@pytest.fixture
def no_xformers(monkeypatch):
    for name in ("xformers", "xformers.ops", "xformers.ops.fmha", "xformers.ops.fmha.attn_bias"):
        monkeypatch.setitem(sys.modules, name, None)


def cuda_spec(dtype=torch.bfloat16, head_size=64, block_size=16, capability="platform", **kw):
    if capability == "platform":
        capability = CudaPlatform.device_capability()
    return AttentionSpec(device_type="cuda", platform_name="cuda", dtype=dtype, head_size=head_size,
                         num_heads=8, num_kv_heads=2, block_size=block_size,
                         device_capability=capability,
                         min_triton_capability=CudaPlatform.min_triton_capability, **kw)


def select(registry, spec, platform="cuda"):
    return select_attention_backend(registry.platforms[platform], spec, registry.backends).name


# ---- selection -----------------------------------------------------------------------------
def test_the_plugin_provides_its_backends_and_runner(registry):
    assert registry.backends["FLASH_ATTN"] is FlashAttentionBackend
    assert registry.backends["XFORMERS"] is XFormersBackend
    assert CudaPlatform.model_runner_cls() is ModelRunner  # the core's, replaying graphs:
    assert CudaPlatform.supports_graph_capture
    assert CudaPlatform.attention_backend_preferences[:4] == ("FLASH_ATTN", "XFORMERS", "TRITON",
                                                              "TORCH_SDPA")


def test_flash_attn_first_on_an_ampere_or_newer_gpu(registry, gpu, fake_flash_attn, triton_compiles):
    gpu((8, 0))
    fake_flash_attn()
    assert select(registry, cuda_spec()) == "FLASH_ATTN"
    assert select(registry, cuda_spec(dtype=torch.float16, head_size=128, block_size=32)) == "FLASH_ATTN"


def test_flash_attn_refusals_say_why(gpu, fake_flash_attn, no_flash_attn, triton_compiles):
    gpu((7, 5))
    assert FlashAttentionBackend.validate(cuda_spec(dtype=torch.float32, head_size=70, block_size=8)) == [
        "dtype float32 not supported (supports float16, bfloat16)",
        "head size 70 not supported (multiples of 8 up to 256)",
        "needs compute capability 8.0+, this GPU has 7.5",
        "block size 8 is not a multiple of 16",
        "flash-attn is not importable (no flash-attention library imports (vllm_flash_attn: "
        "ModuleNotFoundError: import of vllm_flash_attn halted; None in sys.modules; flash_attn: "
        "ModuleNotFoundError: import of flash_attn halted; None in sys.modules)); pip install "
        "'omniinfer-cuda[flash-attn]'",
    ]
    assert FlashAttentionBackend.validate(cuda_spec(capability=None))[0] == (
        "needs an NVIDIA GPU of compute capability 8.0+ (none known)")


def test_flash_attn_with_upstream_needs_triton_for_decode(gpu, fake_flash_attn):
    gpu((9, 0))
    fake_flash_attn("flash_attn", 256)  # and TRITON_INTERPRET=1 here: triton refuses the GPU
    assert FlashAttentionBackend.validate(cuda_spec()) == [
        "TRITON_INTERPRET=1 makes triton interpret the kernels on the host; unset it to run them "
        "compiled on cuda (needed: flash_attn's paged KV takes only multiples of 256 as block size)"]
    fake_flash_attn("vllm_flash_attn", 16)  # the fork pages blocks of 16 itself: no triton needed
    assert FlashAttentionBackend.validate(cuda_spec()) == []


def test_without_flash_attn_xformers_then_triton_then_sdpa(registry, gpu, no_flash_attn,
                                                          fake_xformers, triton_compiles, monkeypatch):
    gpu((8, 6))
    assert select(registry, cuda_spec()) == "XFORMERS"
    for name in ("xformers", "xformers.ops", "xformers.ops.fmha", "xformers.ops.fmha.attn_bias"):
        monkeypatch.setitem(sys.modules, name, None)
    assert select(registry, cuda_spec()) == "TRITON"
    monkeypatch.setattr("omniinfer.kernels.triton.unavailable_reasons",
                        lambda device_type: ["triton is not installed (pip install 'triton>=3.0')"])
    assert select(registry, cuda_spec()) == "TORCH_SDPA"


def test_an_old_gpu_in_float32_gets_triton(registry, gpu, fake_flash_attn, fake_xformers, triton_compiles):
    gpu((7, 5))
    fake_flash_attn()
    assert select(registry, cuda_spec(dtype=torch.float32)) == "XFORMERS"
    gpu((7, 0))
    assert select(registry, cuda_spec(dtype=torch.float32)) == "TORCH_SDPA"


def test_when_nothing_fits_every_candidate_says_why(registry, gpu, no_flash_attn, no_xformers,
                                                    triton_compiles):
    gpu((8, 0))
    with pytest.raises(ValueError) as info:
        select(registry, cuda_spec(dtype=torch.float64, block_size=8, head_size=512))
    lines = str(info.value).splitlines()
    assert lines[0] == ("no attention backend can serve this configuration on cuda (dtype float64, "
                        "head size 512, device type cuda, block size 8); candidates:")
    assert lines[1].startswith("  FLASH_ATTN: dtype float64 not supported (supports float16, "
                               "bfloat16); head size 512 not supported (multiples of 8 up to 256)")
    assert "block size 8 is not a multiple of 16" in lines[1]
    assert lines[2].startswith("  XFORMERS: dtype float64 not supported")
    assert "head size 512 not supported (multiples of 8 up to 256)" in lines[2]
    assert "xformers is not importable" in lines[2]
    assert lines[3] == ("  TRITON: dtype float64 not supported (supports float32, bfloat16, "
                        "float16); head size 512 > 256 (the kernels keep a head in registers)")
    assert [line.split(":")[0] for line in lines[4:]] == [
        "  TORCH_SDPA", "  REFERENCE", "  ROCM_FLASH"]
    assert "ROCM_FLASH: dtype float64 not supported (supports float16, bfloat16); serves the rocm " \
           "platform only, not cuda" in str(info.value)


# ---- metadata builders: the tensors the kernels' contracts ask for --------------------------
# block size 16: A is a prompt of 3 in block 5; B is a 2-token chunk after 16 cached tokens in
# blocks [2, 7]; C decodes its 21st token with blocks [1, 3].
BATCH = [(0, 3, [5], True), (16, 2, [2, 7], True), (20, 1, [1, 3], False)]


def _build(builder_cls):
    common = common_for([(ctx, q, table) for ctx, q, table, _ in BATCH], 16,
                        builder_cls.needs_prefill_key_slots)
    return builder_cls(16).build(common)


def test_flash_attn_builder_matches_the_varlen_contract():
    md = _build(FlashAttentionMetadataBuilder)
    int32 = torch.int32
    assert (md.num_prefills, md.num_prefill_tokens, md.num_decode_tokens) == (2, 5, 1)
    assert md.query_start_loc.dtype == md.cu_seqlens_k.dtype == md.block_tables.dtype == int32
    assert md.query_start_loc.tolist() == [0, 3, 5, 6]  # cu_seqlens_q
    assert md.cu_seqlens_k.tolist() == [0, 3, 21, 42]
    assert md.seq_lens_tensor.tolist() == [3, 18, 21] and md.seq_lens_tensor.dtype == int32
    assert md.block_tables.tolist() == [[5, 0], [2, 7], [1, 3]]
    assert md.slot_mapping.tolist() == [80, 81, 82, 112, 113, 52]
    assert md.prefill_key_slots.tolist() == [80, 81, 82, *range(32, 48), 112, 113]
    assert (md.max_query_len, md.max_seq_len, md.max_prefill_context_len) == (3, 21, 16)
    p = md.prefill_metadata
    assert p.query_start_loc.tolist() == [0, 3, 5] and p.cu_seqlens_k.tolist() == [0, 3, 21]
    assert (p.max_query_len, p.max_seq_len, p.block_tables.tolist()) == (3, 18, [[5, 0], [2, 7]])
    assert p.prefill_key_slots.tolist() == md.prefill_key_slots.tolist()
    d = md.decode_metadata
    assert d.seq_lens_tensor.tolist() == [21] and d.block_tables.tolist() == [[1, 3]]
    assert d.cu_seqlens_k.tolist() == [0, 21] and d.prefill_key_slots.numel() == 0
    assert (d.max_query_len, d.max_seq_len, d.max_prefill_context_len) == (1, 21, 0)


def test_xformers_builder_and_biases(fake_xformers):
    md = _build(PrefillKeySlotsMetadataBuilder)
    assert md.prefill_key_slots.tolist() == [80, 81, 82, *range(32, 48), 112, 113]
    assert md.max_prefill_context_len == 16
    p = md.prefill_metadata
    assert (p.query_lens, p.seq_lens) == ([3, 2], [3, 18])
    bias_mod = sys.modules["xformers.ops.fmha.attn_bias"]
    bias = prefill_bias(bias_mod, p.query_lens, p.seq_lens, None)
    assert type(bias).__name__ == "BlockDiagonalCausalFromBottomRightMask"
    assert (bias.q_seqlen, bias.kv_seqlen) == ([3, 2], [3, 18])
    assert type(prefill_bias(bias_mod, [3, 2], [3, 2], None)).__name__ == "BlockDiagonalCausalMask"
    local = prefill_bias(bias_mod, [3, 2], [3, 18], 4)
    assert (type(local).__name__, local.window) == ("BlockDiagonalCausalLocalAttentionFromBottomRightMask", 4)
    assert type(prefill_bias(bias_mod, [3], [3], 4)).__name__ == "BlockDiagonalCausalLocalAttentionMask"
    # what the bias lets the chunk of B (queries at positions 16, 17) see: keys 0..16, 0..17
    allowed = bias.materialize_bool()
    assert allowed[3].nonzero().flatten().tolist() == list(range(3, 3 + 17))
    assert allowed[4].nonzero().flatten().tolist() == list(range(3, 3 + 18))


# ---- contract tests: the forward paths against stand-ins of the libraries --------------------
@pytest.mark.parametrize("case", [Case("mixed", MIXED, block_size=16), Case("chunked", CHUNKED, block_size=32),
                                  Case("window", MIXED, block_size=16, sliding_window=7, group=4)],
                         ids=["mixed", "chunked", "window"])
def test_contract_flash_attn_upstream(fake_flash_attn, case):
    """Upstream flash-attn pages only 256-token blocks: prefill reads gathered keys, decode
    runs the Triton kernel (interpreted here)."""
    module = fake_flash_attn("flash_attn", 256)
    assert_matches_reference(run_case(FlashAttentionBackend, case, "cpu", torch.float16), torch.float16)
    assert set(module.calls) == {("varlen", False)}


@pytest.mark.parametrize("case", [Case("mixed", MIXED, block_size=16), Case("chunked", CHUNKED, block_size=32),
                                  Case("window", MIXED, block_size=16, sliding_window=7, group=4)],
                         ids=["mixed", "chunked", "window"])
def test_contract_flash_attn_paged_fork(fake_flash_attn, case):
    """vLLM's fork pages 16-token multiples: varlen with block_table, kvcache decode."""
    module = fake_flash_attn("vllm_flash_attn", 16)
    assert_matches_reference(run_case(FlashAttentionBackend, case, "cpu", torch.bfloat16), torch.bfloat16)
    assert {("varlen", True), ("kvcache", True)} <= set(module.calls)
    assert ("varlen", False) in module.calls  # the context-filling prompts need no cache reads


def test_contract_flash_attn_prompts_only(fake_flash_attn):
    module = fake_flash_attn("flash_attn", 256)
    case = Case("prompts", ((0, 1), (0, 17), (0, 40)), group=1)
    assert_matches_reference(run_case(FlashAttentionBackend, case, "cpu", torch.float16), torch.float16)
    assert module.calls == [("varlen", False)]


@pytest.mark.parametrize("case", [Case("mixed", MIXED, block_size=16), Case("chunked", CHUNKED, block_size=32),
                                  Case("window", MIXED + CHUNKED, block_size=16, sliding_window=9)],
                         ids=["mixed", "chunked", "window"])
def test_contract_xformers(fake_xformers, case):
    assert_matches_reference(run_case(XFormersBackend, case, "cpu", torch.float16), torch.float16)
    assert fake_xformers.calls  # every prefill went through memory_efficient_attention_forward


@pytest.mark.parametrize("backend", [FlashAttentionBackend, XFormersBackend], ids=lambda b: b.name)
@pytest.mark.parametrize("check", ["test_common_fields", "test_prefill_and_decode_parts",
                                   "test_single_stage_batches_are_their_own_part",
                                   "test_moves_and_round_trips", "test_multi_step_decode_metadata",
                                   "test_advance_built_decode_metadata",
                                   "test_builds_from_the_common_description"])
def test_builder_invariants_of_the_conformance_kit(backend, check):
    """The kit's builder checks, run here on builders whose backends need a GPU to be runnable."""
    from omniinfer.testing.conformance import test_metadata

    conformance = SimpleNamespace(backend=lambda name: backend, device=torch.device("cpu"))
    getattr(test_metadata, check)(conformance, backend.name)
