"""The greedy token of one or two rows through the LM head's int8 copy (omni_linear_argmax_q8):
always the argmax of what omni_linear stores, whatever the bound leaves to exact sums."""

from __future__ import annotations

import pytest
import torch

from omniinfer import LLM, SamplingParams
from omniinfer.models.layers.embedding import ParallelLMHead
from omniinfer_cpu.kernels import build
from omniinfer_cpu.layer_ops import CpuLayerOps
from omniinfer_cpu.linear import DTYPE_CODES, ENV_Q8, Q8_MAX_MISSES, CpuLinearMethod

pytestmark = pytest.mark.skipif(build.load() is None, reason=f"CPU kernels unavailable: "
                                f"{build.unavailable_reason()}")
DTYPES = [torch.float32, torch.bfloat16]


def lm_head(weight: torch.Tensor, kernels=None) -> tuple[ParallelLMHead, CpuLinearMethod]:
    head = ParallelLMHead(*weight.shape)
    head.weight.data = weight
    method = CpuLinearMethod(kernels or build.load(), pack=True)
    head.linear_method = method
    method.process_weights_after_loading(head)
    return head, method


def q8_tokens(kernels, head, x, threads, max_candidates=1 << 30):
    """(result code, tokens) of omni_linear_argmax_q8 itself."""
    num_out, num_in = head.weight.shape
    out = torch.full((x.shape[0],), -7, dtype=torch.int64)
    rc = kernels.linear_argmax_q8(x.data_ptr(), x.stride(0), head.weight.data_ptr(), head.linear_method.q8_weight.data_ptr(),
                                  head.linear_method.q8_scale.data_ptr(), head.linear_method.q8_coef.data_ptr(), out.data_ptr(), x.shape[0],
                                  num_out, num_in, DTYPE_CODES[x.dtype], max_candidates, threads)
    return rc, out


def stored_argmax(kernels, weight, x, threads):
    """torch.argmax of omni_linear's logits, computed with `threads` threads."""
    num_out, num_in = weight.shape
    y = torch.empty(x.shape[0], num_out, dtype=x.dtype)
    kernels.linear(x.data_ptr(), x.stride(0), weight.data_ptr(), None, y.data_ptr(), num_out, x.shape[0],
                   num_out, num_in, DTYPE_CODES[x.dtype], threads)
    return y.argmax(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_out,num_in", [(5000, 96), (2053, 200), (300, 33), (64, 7)])
def test_tokens_are_the_argmax_of_the_stored_logits(isa_level, dtype, num_out, num_in):
    """Random heads and inputs at several scales, one and two rows, one and two threads (which
    decide how omni_linear rounds a bfloat16 row: a thread's groups of VL rows, the rest)."""
    kernels = build.load()
    gen = torch.Generator().manual_seed(num_out)
    head, _ = lm_head((torch.randn(num_out, num_in, generator=gen) * 0.05).to(dtype))
    for trial in range(12):
        for rows in (1, 2):
            x = (torch.randn(rows, num_in + 3, generator=gen) * 10 ** (trial % 4 - 1)).to(dtype)[:, :num_in]
            for threads in (1, 2):
                rc, tokens = q8_tokens(kernels, head, x, threads)
                assert rc == 0 and tokens.tolist() == stored_argmax(kernels, head.weight, x, threads).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
def test_near_ties_nan_infinity_and_zeros(isa_level, dtype):
    """Rows a rounding apart (equal once stored: the first wins), duplicated rows, a NaN weight (a
    NaN logit is the greatest), an infinite one, all-zero rows and an all-zero input."""
    kernels = build.load()
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(1, 64, generator=gen)
    weight = base + 1e-4 * torch.randn(400, 64, generator=gen)  # logits within a bfloat16 ulp or so
    weight[[10, 200]] = weight[50].clone()  # exact duplicates
    weight[300:310] = 0.0
    weight = weight.to(dtype)
    head, _ = lm_head(weight.clone())
    for i in range(40):
        x = torch.randn(i % 2 + 1, 64, generator=gen).to(dtype)
        for threads in (1, 2):
            rc, tokens = q8_tokens(kernels, head, x, threads)
            assert rc == 0 and tokens.tolist() == stored_argmax(kernels, head.weight, x, threads).tolist()
    zero = torch.zeros(2, 64, dtype=dtype)
    rc, tokens = q8_tokens(kernels, head, zero, 2)
    assert rc == 0 and tokens.tolist() == [0, 0]  # all logits 0: the first row
    special = weight.clone()
    special[7, 3] = float("nan")
    special[123, 5] = float("inf")
    head, _ = lm_head(special)
    x = torch.randn(2, 64, generator=gen).to(dtype)
    x[1, 5] = 0.0  # row 1: inf * 0 is NaN at 123 too, after the NaN at 7
    for threads in (1, 2):
        rc, tokens = q8_tokens(kernels, head, x, threads)
        assert rc == 0 and tokens.tolist() == stored_argmax(kernels, head.weight, x, threads).tolist() == [7, 7]


def test_an_input_along_a_rows_quantization_error(isa_level):
    """The bound must hold where it is tight: x along row A's quantization error, so that A's exact
    logit exceeds its int8 estimate by nearly all of the bound, and a row B (exact in int8) whose
    logit lies between the two. The token is A; a bound half as wide would have dropped A for B."""
    kernels = build.load()
    gen = torch.Generator().manual_seed(8)
    num_in = 64
    weight = torch.randn(500, num_in, generator=gen) * 1e-3
    weight[100] = torch.randn(num_in, generator=gen)  # row A
    head, _ = lm_head(weight.clone())
    w_a = weight[100].double()
    err = w_a - head.linear_method.q8_scale[100].double() * head.linear_method.q8_weight[100].double()
    x = (err / err.norm() + 0.5 * w_a / w_a.norm()).float()
    approx = head.linear_method.q8_scale[100].double() * (head.linear_method.q8_weight[100].double() @ x.double())
    exact = w_a @ x.double()
    assert exact - approx > 0.85 * err.norm() * x.double().norm()  # the error near its bound
    q_b = torch.round(127 * x / x.abs().max()).double()  # row B: a scale times integers
    weight[300] = ((approx + 0.8 * (exact - approx)) / (q_b @ x.double()) * q_b).float()
    head, _ = lm_head(weight)
    x = x[None]
    assert stored_argmax(kernels, head.weight, x, 1).item() == 100
    assert q8_tokens(kernels, head, x, 1)[1].item() == 100


@pytest.mark.parametrize("dtype", DTYPES)
def test_what_goes_back_to_the_logits(isa_level, dtype):
    """A non-finite input and too many rows near the top are refused (nothing written) and the
    method takes the logits; after Q8_MAX_MISSES refusals in a row it drops the copy."""
    kernels = build.load()
    gen = torch.Generator().manual_seed(5)
    head, method = lm_head((torch.randn(1000, 64, generator=gen) * 0.05).to(dtype))
    argmax_rows = CpuLayerOps(kernels).argmax_rows
    x = torch.randn(1, 64, generator=gen).to(dtype)
    x[0, 9] = float("inf")
    assert q8_tokens(kernels, head, x, 1)[0] == -1
    assert method.apply_argmax(head, x, argmax_rows).tolist() == method.apply(head, x).argmax(-1).tolist()
    flat, flat_method = lm_head(torch.ones(5000, 64, dtype=dtype))  # every logit equal
    x = torch.randn(2, 64, generator=gen).to(dtype)
    assert q8_tokens(kernels, flat, x, 1, max_candidates=100)[0] == -2
    for _ in range(Q8_MAX_MISSES):
        assert flat.linear_method.q8_weight is not None
        assert flat_method.apply_argmax(flat, x, argmax_rows).tolist() == [0, 0]
    assert flat.linear_method.q8_weight is None


def test_switched_off_and_only_for_the_lm_head(monkeypatch, checkpoint_dir):
    llm = LLM(checkpoint_dir("llama"), num_kv_blocks=64)
    model = llm.llm_engine.executor.worker.model_runner.model
    assert model.lm_head.linear_method.q8_weight is not None
    assert all(m.linear_method.q8_weight is None for name, m in model.named_modules()
               if hasattr(m, "linear_method") and name != "lm_head")
    monkeypatch.setenv(ENV_Q8, "0")
    llm = LLM(checkpoint_dir("llama"), num_kv_blocks=64)
    assert llm.llm_engine.executor.worker.model_runner.model.lm_head.linear_method.q8_weight is None
    out = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
