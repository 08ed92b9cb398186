"""float32 weights with coded top bytes (omni_ec_pack / omni_linear_ec): the weights' exact values
in 7/8 of the bytes, and omni_linear's sums from them bit for bit, whatever the rows need patched."""

from __future__ import annotations

import pytest
import torch

from omniinfer import LLM, SamplingParams
from omniinfer.models.layers.linear import ReplicatedLinear
from omniinfer_cpu.kernels import build
from omniinfer_cpu.linear import (
    EC_BYTES,
    EC_MAX_PATCHES,
    ENV_EC,
    ENV_PACK,
    CpuLinearMethod,
    should_pack,
)

pytestmark = pytest.mark.skipif(build.load() is None, reason=f"CPU kernels unavailable: "
                                f"{build.unavailable_reason()}")
needs_vbmi = pytest.mark.skipif(build.load() is None or not build.load().ec_supported(),
                                reason="this CPU has no AVX-512 VBMI: the coded copy is not built here")


def pack(kernels, weight: torch.Tensor, threads: int = 2) -> tuple[torch.Tensor, int]:
    num_out, num_in = weight.shape
    patches = kernels.ec_count(weight.data_ptr(), num_out, num_in, threads)
    assert patches >= 0
    copy = torch.empty(kernels.ec_size(num_out, num_in, patches), dtype=torch.uint8)
    assert kernels.ec_pack(weight.data_ptr(), num_out, num_in, patches, copy.data_ptr(), threads) == 0
    return copy, patches


def products(kernels, weight, coded, x, bias, threads):
    """(omni_linear's y, omni_linear_ec's y) for x [M, K] (rows with a stride of K + 5)."""
    num_out, num_in = weight.shape
    plain, ec = (torch.full((x.shape[0], num_out + 3), 7.0) for _ in range(2))
    bias_ptr = None if bias is None else bias.data_ptr()
    kernels.linear(x.data_ptr(), x.stride(0), weight.data_ptr(), bias_ptr, plain.data_ptr(), plain.stride(0),
                   x.shape[0], num_out, num_in, 0, threads)
    assert kernels.linear_ec(x.data_ptr(), x.stride(0), coded.data_ptr(), bias_ptr, ec.data_ptr(), ec.stride(0),
                             x.shape[0], num_out, num_in, threads) == 0
    return plain, ec


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def expected_patches(weight: torch.Tensor) -> int:
    """The weights no row table holds: top bytes other than 0x00 and the row's 15 most frequent
    others (the smaller byte first among equals)."""
    top = (weight.view(torch.int32) >> 24) & 0xFF
    total = 0
    for row in top:
        counts = torch.bincount(row, minlength=256)
        counts[0] = 0
        order = sorted(range(1, 256), key=lambda b: (-int(counts[b]), b))
        total += int(counts.sum()) - sum(int(counts[b]) for b in order[:15])
    return total


def x_rows(gen, rows, num_in, scale=1.0):
    return (torch.randn(rows, num_in + 5, generator=gen) * scale)[:, :num_in]


@needs_vbmi
@pytest.mark.parametrize("num_out,num_in", [(96, 896), (300, 64), (37, 48), (1000, 16), (17, 80), (40, 4864)])
def test_the_sums_of_omni_linear_bit_for_bit(num_out, num_in):
    """Initialised-like weights at several scales, one to five rows, with and without a bias, one
    and two threads (each thread's rows in groups of 16, then the rest)."""
    kernels = build.load()
    gen = torch.Generator().manual_seed(num_out * num_in)
    for scale in (0.02, 1.0, 3e4):
        weight = torch.randn(num_out, num_in, generator=gen) * scale
        coded, patches = pack(kernels, weight)
        assert patches == expected_patches(weight)
        assert coded.numel() < 0.9 * weight.numel() * 4 + 200 * num_out + 8 * patches + 100
        for rows in (1, 2, 3, 5):
            x = x_rows(gen, rows, num_in)
            for bias in (None, torch.randn(num_out, generator=gen)):
                for threads in (1, 2):
                    plain, ec = products(kernels, weight, coded, x, bias, threads)
                    assert same_bits(plain, ec), (scale, rows, bias is None, threads)


@needs_vbmi
def test_patched_weights_and_special_values():
    """Rows of widely spread magnitudes (many patches, some in every group of 16), NaN, infinite,
    denormal, signed-zero and all-zero weights, and inputs with infinities and NaN: the same bits."""
    kernels = build.load()
    gen = torch.Generator().manual_seed(5)
    num_out, num_in = 70, 192
    weight = torch.randn(num_out, num_in, generator=gen) * 0.05
    weight[3] *= torch.pow(2.0, torch.randint(-60, 60, (num_in,), generator=gen).float())
    weight[4] = torch.randn(num_in, generator=gen) * torch.pow(2.0, torch.randint(-120, 120, (num_in,),
                                                                                  generator=gen).float())
    weight[5, 7], weight[5, 100] = float("nan"), float("-inf")
    weight[6, :20] = 1e-40  # denormals
    weight[7] = -0.0
    weight[8] = 0.0
    weight[9, ::2] = -weight[9, ::2].abs()
    weight[10, 63], weight[10, 64], weight[10, 191] = 1e30, -1e-30, 7e20  # patches at groups' edges
    coded, patches = pack(kernels, weight, threads=1)
    assert patches == expected_patches(weight) and patches > num_in  # row 4 alone needs many
    for rows in (1, 2, 4):
        for threads in (1, 2):
            for special in (None, float("inf"), float("nan")):
                x = x_rows(gen, rows, num_in)
                if special is not None:
                    x[0, 11] = special
                plain, ec = products(kernels, weight, coded, x, torch.randn(num_out, generator=gen), threads)
                assert same_bits(plain, ec), (rows, threads, special)
    # a one-hot input reads a column back: every weight's value survives the coding (rows
    # without NaN or infinity, which make every product of theirs NaN)
    finite = weight.isfinite().all(1)
    for column in (0, 7, 63, 64, 100, 191):
        x = torch.zeros(1, num_in)
        x[0, column] = 1.0
        plain, ec = products(kernels, weight, coded, x, None, 1)
        expected = weight[:, column] + 0.0  # (a -0 weight sums to +0 either way)
        assert same_bits(ec[0, :num_out][finite], expected[finite]) and same_bits(plain, ec)


def test_what_the_kernels_refuse():
    kernels = build.load()
    weight = torch.randn(8, 40)
    assert kernels.ec_count(weight.data_ptr(), 8, 40, 1) == -1  # K not a multiple of 16
    if not kernels.ec_supported():
        pytest.skip("this CPU has no AVX-512 VBMI: the coded copy is not built here")
    weight = torch.randn(8, 48)
    patches = kernels.ec_count(weight.data_ptr(), 8, 48, 1)
    out = torch.empty(kernels.ec_size(8, 48, patches + 1), dtype=torch.uint8)
    assert kernels.ec_pack(weight.data_ptr(), 8, 48, patches + 1, out.data_ptr(), 1) == -1
    x, y = torch.randn(1, 40), torch.empty(1, 8)
    assert kernels.linear_ec(x.data_ptr(), 40, out.data_ptr(), None, y.data_ptr(), 8, 1, 8, 40, 1) == -1


@pytest.mark.parametrize("march", ["-march=haswell", "-march=skylake-avx512"])
def test_builds_without_vbmi_make_no_copy(march):
    """Without AVX-512 VBMI the library says so, refuses, and the linear method runs omni_linear."""
    kernels = build.Kernels(build.library_path((march,)))
    assert kernels.ec_supported() == 0
    weight = torch.randn(32, 64)
    assert kernels.ec_count(weight.data_ptr(), 32, 64, 1) == -1
    layer, method = linear_layer(weight, kernels)
    assert layer.ec_weight is None
    x = torch.randn(2, 64)
    assert torch.allclose(method.apply(layer, x), x @ weight.T, atol=1e-5)


def linear_layer(weight: torch.Tensor, kernels=None, pack: bool = True):
    layer = ReplicatedLinear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data = weight
    method = CpuLinearMethod(kernels or build.load(), pack=pack)
    layer.linear_method = method
    method.process_weights_after_loading(layer)
    return layer, method


@needs_vbmi
def test_which_layers_get_a_copy(monkeypatch):
    """float32 weights with packing on and few patches; one and two rows then go through the copy,
    with omni_linear's result."""
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(48, 64, generator=gen) * 0.1
    layer, method = linear_layer(weight)
    assert layer.ec_weight is not None
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
        x = torch.randn(rows, 64, generator=gen)
        y = torch.empty(rows, 48)
        kernels.linear(x.data_ptr(), 64, weight.data_ptr(), None, y.data_ptr(), 48, rows, 48, 64, 0, 1)
        assert same_bits(method.apply(layer, x), y)
    assert calls == [1, 2]
    assert linear_layer(weight, pack=False)[0].ec_weight is None
    assert linear_layer(weight.to(torch.bfloat16))[0].ec_weight is None
    assert linear_layer(torch.randn(48, 40))[0].ec_weight is None  # K not a multiple of 16
    spread = torch.randn(48, 64, generator=gen) * torch.pow(2.0, torch.randint(-100, 100, (48, 64),
                                                                               generator=gen).float())
    assert expected_patches(spread) > EC_MAX_PATCHES * spread.numel()
    assert linear_layer(spread)[0].ec_weight is None  # too many patches to be worth it
    monkeypatch.setenv(ENV_EC, "0")
    assert linear_layer(weight)[0].ec_weight is None


@needs_vbmi
def test_in_the_engine(monkeypatch, checkpoint_dir, hf_greedy):
    """A float32 model's linear layers get copies (moved into huge pages with the weights, read by
    the decoder stack); greedy tokens and log-probabilities are those without them, and
    transformers' tokens."""
    path = checkpoint_dir("llama")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    prompts = [[5, 9, 14, 3], [8, 8, 1]]

    def run(llm):
        out = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(r.outputs[0].token_ids, [sorted((t, e.logprob) for t, e in lp.items()) for lp in r.outputs[0].logprobs])
                for r in out]

    llm = LLM(path, num_kv_blocks=64)
    model = llm.llm_engine.executor.worker.model_runner.model
    linears = [m for m in model.modules() if hasattr(m, "linear_method")]
    assert linears and all(m.ec_weight is not None for m in linears)
    stack = model.decoder_stack
    got = run(llm)  # (one and two decoding rows: the stack's products through the copies)
    assert stack.layers[0].qkv_ec == stack.specs[0].qkv_proj.ec_weight.data_ptr()
    monkeypatch.setenv(ENV_EC, "0")
    plain = LLM(path, num_kv_blocks=64)
    assert all(m.ec_weight is None for m in plain.llm_engine.executor.worker.model_runner.model.modules()
               if hasattr(m, "linear_method"))
    assert run(plain) == got
    for prompt, (tokens, _) in zip(prompts, got):
        assert tokens == hf_greedy(path, prompt, params.max_tokens)


def test_the_copies_count_in_the_packing_budget(monkeypatch, checkpoint_dir):
    """Packing (and so the coded and int8 copies) needs the packed copies, 7/8 of the float32
    weights again and the int8 head within a quarter of the available memory."""
    monkeypatch.delenv(ENV_PACK, raising=False)
    model = LLM(checkpoint_dir("llama"), num_kv_blocks=64).llm_engine.executor.worker.model_runner.model
    weights = {id(m.weight): m.weight for m in model.modules() if hasattr(m, "linear_method")}
    assert all(w.dtype == torch.float32 for w in weights.values())
    need = sum(w.numel() * 4 + int(w.numel() * 4 * EC_BYTES) for w in weights.values())
    need += model.lm_head.weight.numel()
    assert should_pack(model, 4 * need) and not should_pack(model, 4 * need - 4)
