"""The CPU plugin's compiled kernels against torch, the engine on them, and the torch fallback
when they are unavailable (switched off, or no compiler)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from omniinfer import LLM, SamplingParams
from omniinfer.attention.backend import AttentionSpec
from omniinfer.attention.selector import select_attention_backend
from omniinfer.platforms.registry import PluginRegistry
from omniinfer.testing.conformance.cases import Case, assert_matches_reference, run_case
from omniinfer_cpu.attention.paged import CpuPagedBackend
from omniinfer_cpu.decoder_stack import CpuDecoderStack
from omniinfer_cpu.kernels import build, isa
from omniinfer_cpu.layer_ops import CpuLayerOps
from omniinfer_cpu.linear import ENV_GEMM, CpuLinearMethod
from omniinfer_cpu.platform import CpuPlatform

needs_kernels = pytest.mark.skipif(build.load() is None, reason=f"CPU kernels unavailable: "
                                   f"{build.unavailable_reason()}")


def cpu_spec():
    return AttentionSpec(device_type="cpu", platform_name="cpu", dtype=torch.float32, head_size=64,
                         num_heads=4, num_kv_heads=2, block_size=16)


BF16_LOGPROB_TOL = 0.06  # measured: 0.015, gemm or oneDNN alike
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture
def kernels_off(monkeypatch):
    monkeypatch.setenv(build.ENV_SWITCH, "0")
    build.reset()
    yield
    monkeypatch.undo()
    build.reset()


class Recording:
    """The kernels with one function's calls recorded: `calls` gets pick(args) for each."""

    def __init__(self, kernels, name: str, pick):
        self._kernels, self._name, self._pick, self.calls = kernels, name, pick, []

    def __getattr__(self, attr):
        fn = getattr(self._kernels, attr)
        if attr != self._name:
            return fn

        def recorded(*args):
            self.calls.append(self._pick(args))
            return fn(*args)

        return recorded


class _Layer(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k,n", [(64, 100), (256, 1027), (896, 160), (33, 7), (1024, 3)])
def test_linear_kernel_matches_torch(isa_level, dtype, rows, k, n):
    gen = torch.Generator().manual_seed(rows * k + n)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    layer = _Layer(torch.randn(n, k, generator=gen).to(dtype))
    bias = torch.randn(n, generator=gen).to(dtype)
    method = CpuLinearMethod(build.load())
    method.process_weights_after_loading(layer)
    expected = F.linear(x.float(), layer.weight.float(), bias.float())
    for b in (None, bias):
        out = method.apply(layer, x, b)
        assert out.dtype == dtype and out.shape == (rows, n)
        want = expected if b is not None else expected - bias.float()
        torch.testing.assert_close(out.float(), want, **TOL[dtype])


def test_linear_kernel_reads_strided_rows_and_falls_back_for_big_batches(isa_level):
    gen = torch.Generator().manual_seed(0)
    layer = _Layer(torch.randn(48, 32, generator=gen))
    method = CpuLinearMethod(build.load(), max_rows=4)
    method.process_weights_after_loading(layer)
    wide = torch.randn(3, 80, generator=gen)
    x = wide[:, 16:48]  # rows 80 elements apart
    torch.testing.assert_close(method.apply(layer, x), F.linear(x, layer.weight))
    big = torch.randn(9, 32, generator=gen)
    torch.testing.assert_close(method.apply(layer, big), F.linear(big, layer.weight))
    half = _Layer(layer.weight.half())
    torch.testing.assert_close(method.apply(half, x.half()), F.linear(x.half(), half.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 9, 64, 130])
def test_onednn_packed_weights_match_torch(dtype, rows, monkeypatch):
    monkeypatch.setenv(ENV_GEMM, "0")  # bfloat16 goes to oneDNN too, as where omni_gemm is not built
    gen = torch.Generator().manual_seed(rows)
    layer = _Layer(torch.randn(300, 96, generator=gen).to(dtype))
    bias = torch.randn(300, generator=gen).to(dtype)
    method = CpuLinearMethod(build.load(), pack=True)
    method.process_weights_after_loading(layer)
    if method.packed_weight is None:
        pytest.skip("oneDNN cannot pack weights here")
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    torch.testing.assert_close(method.apply(layer, x, bias).float(),
                               F.linear(x.float(), layer.weight.float(), bias.float()), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 7, 64, 130, 300])
@pytest.mark.parametrize("k,n", [(96, 300), (256, 64), (2, 70), (1024, 33), (33, 17)])
def test_gemm_matches_torch(isa_level, rows, k, n, dtype):
    """Products of 3+ rows through omni_gemm: partial panels (64 columns on AVX-512, 16 on AVX2),
    row tiles of 1-6, chunks of 120 rows, strided input rows, with and without a bias (bfloat16
    in vdpbf16ps pairs needs an even K: an odd one stays with oneDNN)."""
    gen = torch.Generator().manual_seed(rows * n)
    layer = _Layer(torch.randn(n, k, generator=gen).to(dtype))
    method = CpuLinearMethod(build.load(), pack=True)
    method.process_weights_after_loading(layer)
    odd = dtype == torch.bfloat16 and k % isa_level.gemm_k_multiple(1) != 0
    assert (method.gemm_weight is None) == odd and (method.packed_weight is None) != odd
    x = torch.randn(rows, k + 16, generator=gen).to(dtype)[:, 8:8 + k]
    bias = torch.randn(n, generator=gen).to(dtype)
    for b in (None, bias):
        want = F.linear(x.float(), layer.weight.float(), None if b is None else b.float())
        torch.testing.assert_close(method.apply(layer, x, b).float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 64, 130])
@pytest.mark.parametrize("inter", [32, 48, 1000])
def test_gemm_gated_writes_silu_and_mul(isa_level, rows, inter, dtype):
    """A merged gate_up layer built with silu_and_mul is packed so that omni_gemm writes
    silu(gate) * up: the bits of the plain product followed by the SiLU-and-multiply kernel
    (whose tail of fewer than 16 columns uses the scalar exp: there, as close as bfloat16 allows)."""
    from omniinfer.models.layers.layer_ops import TORCH_LAYER_OPS, SiluAndMul

    gen = torch.Generator().manual_seed(rows + inter)
    weight = torch.randn(2 * inter, 64, generator=gen).to(dtype)
    bias = torch.randn(2 * inter, generator=gen).to(dtype)
    act = SiluAndMul()
    act.ops = CpuLayerOps(build.load())
    gated, plain = _Layer(weight), _Layer(weight)
    gated.silu_and_mul = act
    method, plain_method = CpuLinearMethod(build.load(), pack=True), CpuLinearMethod(build.load(), pack=True)
    method.process_weights_after_loading(gated)  # (each layer's method holds its own copies)
    plain_method.process_weights_after_loading(plain)
    assert method.gemm_gated and not plain_method.gemm_gated
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    for b in (None, bias):
        got = method.apply_silu_and_mul(gated, x, b, act)
        assert got.shape == (rows, inter)
        want = act(plain_method.apply(plain, x, b))
        if inter % 16 == 0:  # bit for bit
            bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
            assert torch.equal(got.view(bits), want.view(bits))
        torch.testing.assert_close(got, want, atol=1e-6, rtol=2 ** -7 if dtype == torch.bfloat16 else 1e-6)
        ref = TORCH_LAYER_OPS.silu_and_mul(F.linear(x.float(), weight.float(), None if b is None else b.float()))
        torch.testing.assert_close(got.float(), ref, **TOL[dtype])


def _no_fallback(logits):
    raise AssertionError("apply_argmax fell back to the logits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, 7, 64, 130, 300])
@pytest.mark.parametrize("n", [17, 64, 300, 1000])
def test_gemm_argmax_is_the_argmax_of_the_product(isa_level, rows, n, dtype):
    """An LM head's greedy tokens found as omni_gemm multiplies (omni_gemm_argmax, no logits
    written): torch.argmax of the product omni_gemm writes, bit for bit. Small integers make
    exact ties across lanes, panels and row chunks (the first column wins); random values make
    bfloat16's rounding decide ties that float32 would not have."""
    gen = torch.Generator().manual_seed(rows * n)
    method = CpuLinearMethod(build.load(), pack=True)
    for ties in (False, True):
        weight = torch.randn(n, 64, generator=gen)
        x = torch.randn(rows, 80, generator=gen)[:, 8:72]  # strided rows
        if ties:
            weight, x = weight.mul(1.5).round().clamp(-2, 2), x.round().clamp(-2, 2)
        layer = _Layer(weight.to(dtype))
        method.process_weights_after_loading(layer)
        x = x.to(dtype)
        got = method.apply_argmax(layer, x, _no_fallback)
        assert got.dtype == torch.int64 and got.tolist() == method.apply(layer, x).argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_argmax_special_values(isa_level, two_threads, dtype):
    """NaN counts as the greatest (the first NaN wins), a row of -inf gives column 0, and ties
    between the two threads' column ranges go to the first column, as torch.argmax; bias and
    strided rows as omni_gemm takes them. 200 columns: panels 0-1 on one thread, 2-3 (with a
    partial last panel) on the other."""
    k = build.load()
    code = 0 if dtype == torch.float32 else 1
    n, kk, rows = 200, 32, 8
    weight = torch.zeros(n, kk, dtype=dtype)
    weight[:, 0] = torch.linspace(-1, 1, n).to(dtype)  # column c: x[:, 0] * weight[c, 0]
    packed = torch.empty(k.gemm_packed_size(n, kk, 0), dtype=dtype)
    k.gemm_pack(weight.data_ptr(), n, kk, 0, code, packed.data_ptr(), 2)
    x = torch.zeros(rows, kk + 8, dtype=dtype)[:, 4:4 + kk]
    x[0, 0] = 1.0  # the greatest weight: the last column (in the partial panel)
    x[1, 0] = -1.0  # the smallest weight times -1: column 0
    x[2, 1] = float("nan")  # NaN times zero weights: a row of NaN, the first wins
    x[3, 0] = float("inf")  # -inf .. inf: the first +inf
    x[4, 0] = 0.0  # all zero (+ bias below): the bias decides
    x[5, 0] = float("-inf")  # +inf where the weights are negative (columns 0-99): column 0
    x[6, 0] = 1e-37  # products partly below float32's normal range (bfloat16 rounds those to 0)
    cases = {
        "none": torch.zeros(n),
        "ties": torch.zeros(n).index_fill_(0, torch.tensor([190, 130, 100, 70]), 5.0),
        "nan": torch.zeros(n).index_fill_(0, torch.tensor([150, 199]), float("nan")),
        "-inf": torch.full((n,), float("-inf")),
    }
    for name, bias in cases.items():
        bias = bias.to(dtype)
        y = torch.empty(rows, n, dtype=dtype)
        assert k.gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), bias.data_ptr(), y.data_ptr(), n,
                      rows, n, kk, 0, code, 2) == 0
        out = torch.full((rows,), -7, dtype=torch.int64)
        assert k.gemm_argmax(x.data_ptr(), x.stride(0), packed.data_ptr(), bias.data_ptr(),
                             out.data_ptr(), rows, n, kk, code, 2) == 0
        assert out.tolist() == y.argmax(-1).tolist(), name
        if name == "ties":
            assert out[4] == 70  # 70 and 100 on the first thread's panels, 130 and 190 on the other's
        if name == "nan":
            assert out[0] == out[4] == 150 and out[2] == 0
        if name == "-inf":
            assert out[4] == 0
    out = torch.full((rows,), -7, dtype=torch.int64)
    assert k.gemm_argmax(x.data_ptr(), x.stride(0), packed.data_ptr(), None, out.data_ptr(), 0, n, kk,
                         code, 2) == 0 and out.tolist() == [-7] * rows  # no rows: nothing written
    assert k.gemm_argmax(x.data_ptr(), x.stride(0), packed.data_ptr(), None, out.data_ptr(), rows, 0,
                         kk, code, 2) == -1  # no columns: no argmax


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_engine_bf16_products_on_omni_gemm(isa_level, checkpoint_dir, hf_logprobs, dtype):
    """A bfloat16 model: prefills and batched decodes go through omni_gemm (the MLP's gate_up
    with SiLU-and-multiply fused), and the log-probabilities stay within bfloat16's reach of
    transformers' float32 run on the same weights."""
    path = checkpoint_dir("llama_bf16")
    llm = LLM(path, num_kv_blocks=64)
    model = llm.llm_engine.executor.worker.model_runner.model
    model.decoder_stack = None  # the layers one by one, through the linear method (the stack: its own test)
    assert llm.llm_engine.config.model.dtype == torch.bfloat16
    methods = [m.linear_method for m in model.modules() if hasattr(m, "linear_method")]
    gemm = Recording(methods[0].gemm, "gemm", lambda args: (args[6], args[9]))  # rows, gated
    for method in methods:
        method.gemm = gemm
    calls = gemm.calls
    prompts = [list(range(5 + i, 25 + 3 * i)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert {(4, 0), (4, 1)} <= set(calls)  # the four decodes, plain and gated
    assert any(rows > 4 for rows, _ in calls)  # the prefill
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0]
        ref = hf_logprobs(path, prompt + completion.token_ids)
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert abs(entry[token].logprob - ref[len(prompt) - 1 + i][token].item()) < BF16_LOGPROB_TOL


@pytest.mark.parametrize("case", [
    Case("decode", ((1, 1), (8, 1), (40, 1), (70, 1)), group=4),
    Case("mixed", ((0, 9), (13, 6), (32, 1), (5, 1)), block_size=8, seed=1),
    Case("window", ((0, 40), (24, 5), (50, 1)), sliding_window=19, seed=2),
    Case("heads80", ((0, 20), (17, 1)), head_size=80, num_kv_heads=1, group=8, seed=3),
])
def test_paged_attention_bfloat16(isa_level, case):
    """The conformance kit covers float32; the bfloat16 path here."""
    assert_matches_reference(run_case(CpuPagedBackend, case, "cpu", torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    # blocks smaller than a 16-key chunk: the chunk's keys are gathered from several blocks
    Case("blocks1", ((0, 5), (3, 4), (20, 1)), block_size=1),
    Case("blocks4", ((0, 21), (9, 3), (37, 1)), block_size=4, seed=4),
    # chunks at offsets inside a big block, a window starting mid-chunk
    Case("blocks64", ((0, 70), (100, 9), (130, 1)), block_size=64, sliding_window=37, seed=5),
    # 7 query heads per KV head: 9-token tiles of 63 rows, rows not a multiple of 4
    Case("group7", ((0, 40), (11, 13), (60, 1)), group=7, num_kv_heads=2, seed=6),
    # more than 16 query tokens, group 1: tiles of 16 tokens, heads split across items
    Case("long", ((0, 50),), group=1, num_kv_heads=2, head_size=48, seed=7),
    # scores hundreds apart: the lazily moved softmax offset must rescale, and never overflow
    Case("peaky", ((0, 40), (70, 1), (33, 9)), query_scale=100.0, block_size=32, seed=8),
])
def test_paged_attention_layouts(isa_level, case, dtype):
    """Shapes the kernel handles on separate paths: gathered chunks, offsets inside a block,
    partial row groups, head sizes that are not a multiple of 16 vector lanes."""
    assert_matches_reference(run_case(CpuPagedBackend, case, "cpu", dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_matches_torch(isa_level, dtype):
    ops = CpuLayerOps(build.load())
    gen = torch.Generator().manual_seed(0)
    for rows, cols in [(1, 1), (3, 17), (64, 32000), (2, 151936), (9, 33)]:
        x = torch.randn(rows, cols + 5, generator=gen).to(dtype)[:, :cols]  # strided rows
        assert ops.argmax_rows(x).tolist() == x.argmax(-1).tolist(), (rows, cols)
    x = torch.full((5, 40), float("-inf"), dtype=dtype)  # row 0: all -inf
    x[1, 7] = 3
    x[2, 5] = x[2, 30] = x[2, 39] = float("nan")  # the first NaN wins, in vector lanes and the tail
    x[3, 20] = x[3, 33] = x[3, 3] = 1  # ties: the first index, across lanes and the tail
    x[4, 38] = float("nan")
    x[4, 1] = float("inf")
    assert ops.argmax_rows(x).tolist() == x.argmax(-1).tolist() == [0, 7, 5, 3, 38]
    # 230 columns: 3 rounds of the 4 interleaved vectors (0-191), 2 single vectors, a tail of 6
    x = torch.zeros(4, 230, dtype=dtype)
    x[0, [150, 90, 20]] = 1  # ties in different interleaved vectors: the first index
    x[1, [64, 17]] = 2  # the later vector holds the smaller index
    x[2, [225, 200]] = 1  # a tie between a single vector and the tail
    x[2, 100] = 0.5
    x[3, 210] = float("nan")
    assert ops.argmax_rows(x).tolist() == x.argmax(-1).tolist() == [20, 17, 200, 210]


def test_engine_runs_on_the_kernels(isa_level, checkpoint_dir, hf_greedy):
    path = checkpoint_dir("llama_tied")
    llm = LLM(path, num_kv_blocks=64)
    engine = llm.llm_engine
    assert engine.attn_backend.name == "CPU_PAGED"
    runner = engine.executor.worker.model_runner
    assert runner.sampler.argmax_rows.__func__ is CpuLayerOps.argmax_rows  # the greedy argmax too
    model = runner.model
    methods = [m.linear_method for m in model.modules() if hasattr(m, "linear_method")]
    assert len(methods) == 2 * 4 + 1 and all(isinstance(m, CpuLinearMethod) for m in methods)
    assert isinstance(model.decoder_stack, CpuDecoderStack)  # the layers in one compiled call
    head = model.lm_head.linear_method
    head._kernels = Recording(head._kernels, "linear_argmax_q8", lambda args: args[7])  # rows
    calls = head._kernels.calls
    prompts = [[5, 6, 7], list(range(10, 45))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 8)
    assert calls == [2] * 8  # the two sequences' greedy tokens from the LM head's int8 copy


@pytest.mark.parametrize("dtype", [torch.float32])
def test_engine_greedy_tokens_from_omni_gemm_argmax(isa_level, checkpoint_dir, hf_greedy, dtype):
    """An all-greedy batch of 3+ sequences takes its tokens from omni_gemm_argmax (the tied LM
    head: the embedding's weight, packed), transformers' tokens; a batch of two from the logits
    of the one-row kernel, as before."""
    path = checkpoint_dir("llama_tied")
    llm = LLM(path, num_kv_blocks=64)
    head = llm.llm_engine.executor.worker.model_runner.model.lm_head
    method = head.linear_method
    method.gemm = Recording(method.gemm, "gemm_argmax", lambda args: args[5])  # rows
    calls = method.gemm.calls
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for prompts, rows in (([[5, 6, 7], list(range(10, 40)), [9, 8], [4]], 4), ([[5, 6], [7]], None)):
        calls.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, 5)
        assert calls == ([rows] * 5 if rows else [])  # the prefill and four decode steps


def test_kernels_switched_off_fall_back_to_torch(kernels_off, checkpoint_dir, hf_greedy):
    assert build.load() is None
    assert build.unavailable_reason() == "switched off (OMNIINFER_CPU_KERNELS=0)"
    assert CpuPagedBackend.validate(cpu_spec()) == [
        "the CPU kernels are unavailable: switched off (OMNIINFER_CPU_KERNELS=0)"]
    registry = PluginRegistry(only="cpu")
    assert select_attention_backend(CpuPlatform, cpu_spec(), registry.backends).name == "TORCH_SDPA"
    path = checkpoint_dir("llama")
    llm = LLM(path, num_kv_blocks=64)
    model = llm.llm_engine.executor.worker.model_runner.model
    methods = [m.linear_method for m in model.modules() if hasattr(m, "linear_method")]
    assert methods and all(isinstance(m, CpuLinearMethod) and m.linear is None
                           for m in methods)  # oneDNN packing only
    prompt = [5, 6, 7, 8]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6,
                                                                     ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(path, prompt, 6)


def test_a_failing_compiler_is_reported(monkeypatch, tmp_path):
    level, why = isa.choose(os.environ.get(isa.ENV_ISA))  # the level build.load() picks (the cap too)
    if level is None:
        pytest.skip(f"no kernel level runs here: {why}")
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path))
    monkeypatch.setenv("CC", "false")  # exits 1, prints nothing
    monkeypatch.setattr(build, "PREBUILT", tmp_path / "no-prebuilt")  # (as a source checkout)
    build.reset()
    order = [lv.name for lv in isa.arch_levels()]
    tried = [lv.name for lv in reversed(isa.runnable_levels()) if order.index(lv.name) <= order.index(level.name)]
    try:
        assert build.load() is None  # every level at or below the chosen one was tried
        assert build.unavailable_reason() == "; ".join(
            f"{name}: false failed to build the CPU kernels for {name}: exit status 1" for name in tried)
        assert list(tmp_path.iterdir()) == []  # nothing half-written left behind
    finally:
        monkeypatch.undo()
        build.reset()


def test_a_level_the_compiler_cannot_build_yields_to_the_one_below(monkeypatch):
    """An older compiler may not know a level's flags (gcc before 11: no -mavxvnni): the best
    level below it is loaded instead of none."""
    level, why = isa.choose(os.environ.get(isa.ENV_ISA))
    if level is None:
        pytest.skip(f"no kernel level runs here: {why}")
    order = [lv.name for lv in isa.arch_levels()]
    below = [lv.name for lv in isa.runnable_levels() if order.index(lv.name) < order.index(level.name)]
    if not below:
        pytest.skip(f"this CPU runs no level below {level.name}")
    failure = f"gcc failed to build the CPU kernels for {level.name}: unrecognized command-line option"
    real = build.library_path

    def library_path(lv):
        if lv.name == level.name:
            raise build.KernelsUnavailable(failure)
        return real(lv)

    monkeypatch.setattr(build, "library_path", library_path)
    build.reset()
    try:
        assert build.load().level.name == below[-1]
        assert build.selection() == (below[-1], f"{level.name}: {failure}; so {below[-1]}, the best level below it")
    finally:
        monkeypatch.undo()
        build.reset()


@pytest.fixture
def two_threads():
    """The kernels split work across torch's thread count (tests otherwise run one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_split_across_threads(isa_level, two_threads, dtype):
    gen = torch.Generator().manual_seed(5)
    layer = _Layer(torch.randn(1001, 64, generator=gen).to(dtype))
    x = torch.randn(2, 64, generator=gen).to(dtype)
    out = CpuLinearMethod(build.load()).apply(layer, x)
    torch.testing.assert_close(out.float(), F.linear(x.float(), layer.weight.float()), **TOL[dtype])
    for case in (Case("decode", tuple((17 * i, 1) for i in range(1, 9))), Case("one", ((40, 1),)),
                 Case("prefill", ((0, 50), (9, 20)), group=4)):
        assert_matches_reference(run_case(CpuPagedBackend, case, "cpu", dtype), dtype)

    # omni_gemm: panels split between the threads (300 columns: 5 panels), and with fewer panels
    # than threads (64 columns, or a gated 2 x 32) chunks of rows x panels (7 rows: 6 + 1)
    if dtype in CpuLinearMethod(build.load(), pack=True).gemm_dtypes:
        from omniinfer.models.layers.layer_ops import TORCH_LAYER_OPS, SiluAndMul

        for n, gated in ((300, False), (64, False), (64, True)):
            layer = _Layer(torch.randn(n, 96, generator=gen).to(dtype))
            if gated:
                layer.silu_and_mul = SiluAndMul()
            method = CpuLinearMethod(build.load(), pack=True)
            method.process_weights_after_loading(layer)
            for rows in (7, 300):
                x = torch.randn(rows, 96, generator=gen).to(dtype)
                want = F.linear(x.float(), layer.weight.float())
                if gated:
                    got, want = method.apply_silu_and_mul(layer, x, None, layer.silu_and_mul), \
                        TORCH_LAYER_OPS.silu_and_mul(want)
                else:
                    got = method.apply(layer, x)
                torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_match_torch(isa_level, dtype):
    """Norm, activation and rotary: bfloat16 results round like torch's, so they are equal."""
    from omniinfer.models.layers.layer_ops import TORCH_LAYER_OPS
    from omniinfer_cpu.layer_ops import CpuLayerOps

    ops = CpuLayerOps(build.load())
    exact = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(7)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    for rows, hidden in ((1, 64), (5, 257), (40, 1024)):
        x, res, w = rand(rows, hidden), rand(rows, hidden), rand(hidden)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), TORCH_LAYER_OPS.rms_norm(x, w, 1e-6), **exact)
        for a, b in zip(ops.rms_norm(x, w, 1e-5, res), TORCH_LAYER_OPS.rms_norm(x, w, 1e-5, res)):
            torch.testing.assert_close(a, b, **exact)
        gate_up = rand(rows, 2 * hidden)
        torch.testing.assert_close(ops.silu_and_mul(gate_up), TORCH_LAYER_OPS.silu_and_mul(gate_up), **exact)
    if dtype == torch.bfloat16:  # NaN, infinities, signed zeros and huge values round alike too
        special = [float("nan"), float("inf"), -float("inf"), 3.0, -2.5, 1e30, 0.0, -0.0]
        gate_up = torch.tensor([special * 4 + [1.0, 2.0, 1.0, float("nan"), 1e38, 1.0, 1e10, -0.0] * 4]
                               * 40, dtype=dtype)
        got, want = ops.silu_and_mul(gate_up), TORCH_LAYER_OPS.silu_and_mul(gate_up)
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)  # (NaN bits may differ)
        assert torch.equal(torch.signbit(got[~got.isnan()]), torch.signbit(want[~want.isnan()]))
        # a float32 denormal result (here silu(1e-39) ~ 5e-40): torch's value, or 0 where the CPU
        # rounds with vcvtneps2bf16 (which reads denormals as zero)
        tiny = torch.tensor([[1e-39] * 32 + [1.0] * 32] * 40, dtype=dtype)
        got, want = ops.silu_and_mul(tiny), TORCH_LAYER_OPS.silu_and_mul(tiny)
        assert ((got == want) | (got == 0)).all() and want.abs().max() < 1e-38
    # whole heads, and partial rotaries (Phi-4-mini's 96 of 128; 12 of 16: no whole vector)
    for head, rot in ((32, 32), (64, 64), (80, 80), (128, 128), (128, 96), (96, 72), (16, 12), (64, 2)):
        qkv = rand(9, 8 * head)
        cos, sin = torch.randn(50, rot // 2, generator=gen), torch.randn(50, rot // 2, generator=gen)
        positions = torch.randint(0, 50, (9,), generator=gen)
        want = TORCH_LAYER_OPS.rotary(positions, *qkv.split([4 * head, 2 * head, 2 * head], -1)[:2],
                                      cos, sin, head)
        q, k, _ = qkv.clone().split([4 * head, 2 * head, 2 * head], -1)  # strided views, rotated in place
        got = ops.rotary(positions, q, k, cos, sin, head)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **exact)
    with pytest.raises(IndexError, match="outside the rotary table"):
        ops.rotary(torch.tensor([50]), rand(1, 64), rand(1, 64), cos[:, :32].contiguous(),
                   sin[:, :32].contiguous(), 64)


def test_weights_in_huge_pages(monkeypatch, checkpoint_dir, hf_greedy):
    from omniinfer_cpu import memory

    if memory.huge_pages_unavailable():
        pytest.skip(memory.huge_pages_unavailable())
    monkeypatch.setattr(memory, "MIN_BYTES", 0)  # the tiny model's tensors move too
    path = checkpoint_dir("llama_tied")
    llm = LLM(path, num_kv_blocks=64)
    runner = llm.llm_engine.executor.worker.model_runner
    arena = runner.transform.weight_arena  # the plugin's transform keeps the mapping alive
    start = torch.frombuffer(arena, dtype=torch.uint8).data_ptr()
    for name, param in runner.model.named_parameters():
        assert start <= param.data_ptr() < start + len(arena), name
    q8 = runner.model.lm_head.linear_method.q8_weight  # the int8 copy the greedy LM head streams, too
    assert q8 is not None and start <= q8.data_ptr() < start + len(arena)
    coded = [m.linear_method.ec_weight for m in runner.model.modules()
             if hasattr(m, "linear_method") and m.linear_method.ec_weight is not None]
    kernels = build.load()
    assert coded or kernels is None or not kernels.ec_supported(0)  # and the weights' coded copies
    assert all(start <= c.data_ptr() < start + len(arena) for c in coded)
    prompt = [9, 8, 7, 6, 5]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6,
                                                                     ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(path, prompt, 6)
    monkeypatch.setenv(memory.ENV_HUGE_PAGES, "0")
    assert memory.move_to_huge_pages(runner.model) is None
