"""Weights with coded top bytes (omni_ec_pack / omni_linear_ec): the weights' exact values in 7/8 of
float32's bytes or 3/4 of bfloat16's, and omni_linear's sums from them bit for bit, whatever the
rows need patched."""

from __future__ import annotations

import pytest
import torch
from conftest import level_params

from omniinfer import LLM, SamplingParams
from omniinfer.models.layers.linear import ReplicatedLinear
from omniinfer_cpu.kernels import build, isa
from omniinfer_cpu.linear import (
    DTYPE_CODES,
    EC_BITS,
    EC_MAX_PATCHES,
    ENV_EC,
    ENV_PACK,
    CpuLinearMethod,
    should_pack,
)

pytestmark = pytest.mark.skipif(build.load() is None, reason=f"CPU kernels unavailable: "
                                f"{build.unavailable_reason()}")
DTYPES = [torch.float32, torch.bfloat16]
LANES = {torch.float32: 16, torch.bfloat16: 32}  # the input width must be a multiple of this


def coded_here(dtype: torch.dtype) -> bool:
    kernels = build.load()
    return kernels is not None and kernels.ec_supported(DTYPE_CODES[dtype]) == 1


def skip_unless_coded(dtype: torch.dtype) -> None:
    if not coded_here(dtype):
        kernels = build.load()
        need = "avx512_bf16" if dtype == torch.bfloat16 else "avx512_vbmi"
        missing = isa.missing_flags(isa.BY_NAME[need])
        pytest.skip(f"no coded {dtype} copies at the level loaded here "
                    f"({kernels.level.name if kernels else 'none'}): they need the {need} kernels"
                    + (f", and this CPU lacks {', '.join(missing)}" if missing else ""))


def pack(kernels, weight: torch.Tensor, threads: int = 2) -> tuple[torch.Tensor, int]:
    num_out, num_in = weight.shape
    dtype = DTYPE_CODES[weight.dtype]
    patches = kernels.ec_count(weight.data_ptr(), num_out, num_in, dtype, threads)
    assert patches >= 0
    copy = torch.empty(kernels.ec_size(num_out, num_in, dtype, patches), dtype=torch.uint8)
    assert kernels.ec_pack(weight.data_ptr(), num_out, num_in, dtype, patches, copy.data_ptr(), threads) == 0
    return copy, patches


def products(kernels, weight, coded, x, bias, threads):
    """(omni_linear's y, omni_linear_ec's y) for x [M, K] (rows with a stride of K + 5)."""
    num_out, num_in = weight.shape
    plain, ec = (torch.full((x.shape[0], num_out + 3), 7.0, dtype=weight.dtype) for _ in range(2))
    bias_ptr = None if bias is None else bias.data_ptr()
    dtype = DTYPE_CODES[weight.dtype]
    kernels.linear(x.data_ptr(), x.stride(0), weight.data_ptr(), bias_ptr, plain.data_ptr(), plain.stride(0),
                   x.shape[0], num_out, num_in, dtype, threads)
    assert kernels.linear_ec(x.data_ptr(), x.stride(0), coded.data_ptr(), bias_ptr, ec.data_ptr(), ec.stride(0),
                             x.shape[0], num_out, num_in, dtype, threads) == 0
    return plain, ec


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a), bits(b))


def expected_patches(weight: torch.Tensor) -> int:
    """The weights no row table holds: top bytes other than 0x00 and the row's 15 most frequent
    others (the smaller byte first among equals)."""
    top = (bits(weight).int() >> (24 if weight.dtype == torch.float32 else 8)) & 0xFF
    total = 0
    for row in top:
        counts = torch.bincount(row, minlength=256)
        counts[0] = 0
        order = sorted(range(1, 256), key=lambda b: (-int(counts[b]), b))
        total += int(counts.sum()) - sum(int(counts[b]) for b in order[:15])
    return total


def x_rows(gen, rows, num_in, dtype, scale=1.0):
    return (torch.randn(rows, num_in + 5, generator=gen) * scale).to(dtype)[:, :num_in]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_out,groups", [(96, 28), (300, 4), (37, 3), (1000, 1), (17, 5), (40, 152)])
def test_the_sums_of_omni_linear_bit_for_bit(dtype, num_out, groups):
    """Initialised-like weights at several scales, one to five rows, with and without a bias, one
    and two threads (each thread's rows in groups of 16, then the rest)."""
    skip_unless_coded(dtype)
    kernels = build.load()
    num_in = groups * LANES[dtype]
    gen = torch.Generator().manual_seed(num_out * num_in)
    for scale in (0.02, 1.0, 3e4):
        weight = (torch.randn(num_out, num_in, generator=gen) * scale).to(dtype)
        coded, patches = pack(kernels, weight)
        assert patches == expected_patches(weight)
        saved = 1 - EC_BITS[dtype] / (8 * weight.element_size())
        assert coded.numel() < (1 - saved) * weight.numel() * weight.element_size() + 90 * num_out + 8 * patches
        for rows in (1, 2, 3, 5):
            x = x_rows(gen, rows, num_in, dtype)
            for bias in (None, torch.randn(num_out, generator=gen).to(dtype)):
                for threads in (1, 2):
                    plain, ec = products(kernels, weight, coded, x, bias, threads)
                    assert same_bits(plain, ec), (scale, rows, bias is None, threads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_patched_weights_and_special_values(dtype):
    """Rows of widely spread magnitudes (many patches, some in every group), NaN, infinite,
    denormal, signed-zero and all-zero weights, patches at groups' edges, and inputs with
    infinities and NaN: the same bits."""
    skip_unless_coded(dtype)
    kernels = build.load()
    gen = torch.Generator().manual_seed(5)
    num_out, num_in, lanes = 70, 192, LANES[dtype]
    weight = torch.randn(num_out, num_in, generator=gen) * 0.05
    weight[3] *= torch.pow(2.0, torch.randint(-60, 60, (num_in,), generator=gen).float())
    weight[4] = torch.randn(num_in, generator=gen) * torch.pow(2.0, torch.randint(-120, 120, (num_in,),
                                                                                  generator=gen).float())
    weight[5, 7], weight[5, 100] = float("nan"), float("-inf")
    weight[6, :20] = 1e-40  # denormals
    weight[7] = -0.0
    weight[8] = 0.0
    weight[9, ::2] = -weight[9, ::2].abs()
    edges = [lanes - 1, lanes, 2 * lanes - 1, num_in - 1]
    weight[10, edges] = torch.tensor([1e30, -1e-30, 7e20, -3e25])
    weight = weight.to(dtype)
    coded, patches = pack(kernels, weight, threads=1)
    assert patches == expected_patches(weight) and patches > num_in  # row 4 alone needs many
    for rows in (1, 2, 4):
        for threads in (1, 2):
            for special in (None, float("inf"), float("nan")):
                x = x_rows(gen, rows, num_in, dtype)
                if special is not None:
                    x[0, 11] = special
                bias = torch.randn(num_out, generator=gen).to(dtype)
                plain, ec = products(kernels, weight, coded, x, bias, threads)
                assert same_bits(plain, ec), (rows, threads, special)
    # a one-hot input reads a column back: every weight's value survives the coding (rows
    # without NaN or infinity, which make every product of theirs NaN)
    finite = weight.isfinite().all(1)
    for column in [0, 7, 100] + edges:
        x = torch.zeros(1, num_in, dtype=dtype)
        x[0, column] = 1.0
        plain, ec = products(kernels, weight, coded, x, None, 1)
        expected = weight[:, column] + 0.0  # (a -0 weight sums to +0 either way)
        shown = finite
        if dtype == torch.bfloat16:  # (the bfloat16 store flushes a denormal sum to zero)
            shown = finite & ((expected == 0) | (expected.float().abs() >= torch.finfo(torch.float32).tiny))
        assert same_bits(ec[0, :num_out][shown], expected[shown]) and same_bits(plain, ec)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sums_that_underflow_to_negative_zero(dtype):
    """Products too small for any float round to -0: omni_linear's sum of such a row is +0 (its
    tail adds +0 to a lane), and so is the coded copy's."""
    skip_unless_coded(dtype)
    kernels = build.load()
    num_out, num_in = 20, 4 * LANES[dtype]
    weight = torch.full((num_out, num_in), -1e-23).to(dtype)
    coded, _ = pack(kernels, weight, threads=1)
    for rows in (1, 2):
        x = torch.full((rows, num_in + 5), 1e-23).to(dtype)[:, :num_in]
        plain, ec = products(kernels, weight, coded, x, None, 1)
        assert same_bits(plain, ec)


@pytest.mark.parametrize("dtype", DTYPES)
def test_what_the_kernels_refuse(dtype):
    kernels, code, lanes = build.load(), DTYPE_CODES[dtype], LANES[dtype]
    weight = torch.randn(8, lanes + 8).to(dtype)
    assert kernels.ec_count(weight.data_ptr(), 8, lanes + 8, code, 1) == -1  # K not a multiple of the lanes
    skip_unless_coded(dtype)
    weight = torch.randn(8, 3 * lanes).to(dtype)
    patches = kernels.ec_count(weight.data_ptr(), 8, 3 * lanes, code, 1)
    out = torch.empty(kernels.ec_size(8, 3 * lanes, code, patches + 1), dtype=torch.uint8)
    assert kernels.ec_pack(weight.data_ptr(), 8, 3 * lanes, code, patches + 1, out.data_ptr(), 1) == -1
    x, y = torch.randn(1, lanes + 8).to(dtype), torch.empty(1, 8, dtype=dtype)
    assert kernels.linear_ec(x.data_ptr(), lanes + 8, out.data_ptr(), None, y.data_ptr(), 8, 1, 8, lanes + 8,
                             code, 1) == -1
    assert kernels.ec_count(weight.data_ptr(), 8, 3 * lanes, 7, 1) == -1  # no such dtype


@pytest.mark.parametrize("level", level_params())
def test_levels_without_the_instructions_make_no_copy(level):
    """Below AVX-512 VBMI (or, for bfloat16, AVX-512 BF16: Ice Lake has VBMI, not BF16) the
    library says so and refuses, and the linear method runs omni_linear."""
    kernels = build.load_level(level)
    for dtype in DTYPES:
        if level in ("avx512_vbmi", "avx512_bf16") and (dtype == torch.float32 or level == "avx512_bf16"):
            assert kernels.ec_supported(DTYPE_CODES[dtype]) == 1
            continue
        assert kernels.ec_supported(DTYPE_CODES[dtype]) == 0
        weight = torch.randn(32, 64).to(dtype)
        assert kernels.ec_count(weight.data_ptr(), 32, 64, DTYPE_CODES[dtype], 1) == -1
        layer, method = linear_layer(weight, kernels)
        assert layer.linear_method.ec_weight is None
        x = torch.randn(2, 64).to(dtype)
        torch.testing.assert_close(method.apply(layer, x), (x.float() @ weight.float().T).to(dtype),
                                   atol=1e-2, rtol=1e-2)


def linear_layer(weight: torch.Tensor, kernels=None, pack: bool = True):
    layer = ReplicatedLinear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data = weight
    method = CpuLinearMethod(kernels or build.load(), pack=pack)
    layer.linear_method = method
    method.process_weights_after_loading(layer)
    return layer, method


@pytest.mark.parametrize("dtype", DTYPES)
def test_which_layers_get_a_copy(monkeypatch, dtype):
    """Weights with packing on, a width the kernel takes and few patches; one and two rows then go
    through the copy, with omni_linear's result."""
    skip_unless_coded(dtype)
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(48, 64, generator=gen) * 0.1).to(dtype)
    layer, method = linear_layer(weight)
    assert layer.linear_method.ec_weight is not None
    kernels, calls = build.load(), []

    class Recording:
        def __getattr__(self, name):
            if name == "linear_ec":
                def linear_ec(*args):
                    calls.append(args[6])
                    return kernels.linear_ec(*args)
                return linear_ec
            return getattr(kernels, name)

    method._kernels = Recording()
    for rows in (1, 2):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        y = torch.empty(rows, 48, dtype=dtype)
        kernels.linear(x.data_ptr(), 64, weight.data_ptr(), None, y.data_ptr(), 48, rows, 48, 64,
                       DTYPE_CODES[dtype], 1)
        assert same_bits(method.apply(layer, x), y)
    assert calls == [1, 2]
    assert linear_layer(weight, pack=False)[0].linear_method.ec_weight is None
    assert linear_layer(torch.randn(48, 40).to(dtype))[0].linear_method.ec_weight is None  # width not a multiple of 16 / 32
    spread = torch.randn(48, 64, generator=gen) * torch.pow(2.0, torch.randint(-100, 100, (48, 64),
                                                                               generator=gen).float())
    spread = spread.to(dtype)
    assert expected_patches(spread) > EC_MAX_PATCHES * spread.numel()
    assert linear_layer(spread)[0].linear_method.ec_weight is None  # too many patches to be worth it
    monkeypatch.setenv(ENV_EC, "0")
    assert linear_layer(weight)[0].linear_method.ec_weight is None


@pytest.mark.parametrize("name", ["llama", "llama_bf16"])
def test_in_the_engine(monkeypatch, checkpoint_dir, hf_greedy, name):
    """A model's linear layers get copies (read by the decoder stack); greedy tokens and
    log-probabilities are those without them, and (float32) transformers' tokens."""
    skip_unless_coded(torch.bfloat16 if name == "llama_bf16" else torch.float32)
    path = checkpoint_dir(name)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 14, 3], [8, 8, 1]]

    def run(llm):
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(r.outputs[0].token_ids, [sorted((t, e.logprob) for t, e in lp.items()) for lp in r.outputs[0].logprobs])
                for r in out]

    llm = LLM(path, num_kv_blocks=64)
    model = llm.llm_engine.executor.worker.model_runner.model
    linears = [m for m in model.modules() if hasattr(m, "linear_method")]
    assert linears and all(m.linear_method.ec_weight is not None for m in linears)
    stack = model.decoder_stack
    got = run(llm)  # (one and two decoding rows: the stack's products through the copies)
    assert stack.layers[0].qkv_ec == stack.specs[0].qkv_proj.linear_method.ec_weight.data_ptr()
    monkeypatch.setenv(ENV_EC, "0")
    plain = LLM(path, num_kv_blocks=64)
    assert all(m.linear_method.ec_weight is None for m in plain.llm_engine.executor.worker.model_runner.model.modules()
               if hasattr(m, "linear_method"))
    assert run(plain) == got
    if name == "llama":
        for prompt, (tokens, _) in zip(prompts, got):
            assert tokens == hf_greedy(path, prompt, params.max_tokens)


def test_the_copies_count_in_the_packing_budget(monkeypatch, checkpoint_dir):
    """Packing (and so the coded and int8 copies) needs the packed copies, the coded ones and the
    int8 head within a quarter of the available memory."""
    monkeypatch.delenv(ENV_PACK, raising=False)
    model = LLM(checkpoint_dir("llama"), num_kv_blocks=64).llm_engine.executor.worker.model_runner.model
    weights = {id(m.weight): m.weight for m in model.modules() if hasattr(m, "linear_method")}
    assert all(w.dtype == torch.float32 for w in weights.values())
    need = sum(w.numel() * 4 + w.numel() * 28 // 8 for w in weights.values())
    need += model.lm_head.weight.numel()
    assert should_pack(model, 4 * need) and not should_pack(model, 4 * need - 4)
