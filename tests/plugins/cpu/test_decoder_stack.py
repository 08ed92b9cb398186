"""The CPU plugin's decoder stack (all decoder layers in one omni_decoder_layers call): bit for bit
the layers one by one, on every kind of step it serves, and the cases it leaves to the model."""

from __future__ import annotations

import pytest
import torch

from omniinfer import LLM, SamplingParams
from omniinfer.distributed import parallel_state as ps
from omniinfer_cpu.decoder_stack import ENV_STACK, CpuDecoderStack, unsupported
from omniinfer_cpu.kernels import build
from omniinfer_cpu.linear import ENV_PACK

pytestmark = pytest.mark.skipif(build.load() is None, reason=f"CPU kernels unavailable: "
                                f"{build.unavailable_reason()}")

PROMPTS = [list(range(5, 25)), [7, 3, 9], list(range(30, 70, 3)), [11] * 9]
PARAMS = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=3)


def model_of(llm):
    return llm.llm_engine.executor.worker.model_runner.model


def record_rows(stack: CpuDecoderStack) -> list[int]:
    """The tokens of each step the stack computed."""
    rows, kernels = [], stack.kernels

    class Recording:
        def decoder_layers(self, *args):
            rows.append(args[7])
            return kernels.decoder_layers(*args)

    stack.kernels = Recording()
    return rows


def run(llm, batches):
    """Tokens and log-probabilities (exact floats) of each batch of prompts, run in turn."""
    out = []
    for batch in batches:
        for r in llm.generate([{"prompt_token_ids": p} for p in batch], PARAMS, use_tqdm=False):
            c = r.outputs[0]
            out.append((c.token_ids, [sorted((t, e.logprob) for t, e in lp.items()) for lp in c.logprobs]))
    return out


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name,threads", [("llama", 1), ("qwen2", 1), ("llama_bf16", 1),
                                          ("mistral_window", 1), ("llama_bf16", 2), ("qwen3_norms", 1),
                                          ("qwen3_norms", 2)])
def test_stack_is_the_layers_bit_for_bit(isa_level, monkeypatch, restore_threads, checkpoint_dir, hf_greedy,
                                         name, threads):
    """Prefills, one and two decoding rows (omni_linear) and four (omni_gemm, where the weights
    are packed for it): the same tokens and the same log-probabilities, to the last bit, as the
    model's layers one by one; and transformers' greedy tokens (float32)."""
    monkeypatch.setenv("OMNIINFER_CPU_THREADS", str(threads))
    path = checkpoint_dir(name)
    batches = [PROMPTS[:1], PROMPTS[:2], PROMPTS]
    llm = LLM(path, num_kv_blocks=64)
    stack = model_of(llm).decoder_stack
    assert isinstance(stack, CpuDecoderStack) and torch.get_num_threads() == threads
    rows = record_rows(stack)
    got = run(llm, batches)
    model_of(llm).decoder_stack = None
    assert run(llm, batches) == got
    assert {1, 2} <= set(rows) and max(rows) >= 20  # decodes of 1 and 2 rows, the prefills
    assert stack.has_gemm and 4 in rows  # (omni_gemm is built at every level)
    if name != "llama_bf16":  # (transformers runs float32; bfloat16 tokens may part from them)
        for prompt, (tokens, _) in zip(PROMPTS, got[3:]):
            assert tokens == hf_greedy(path, prompt, PARAMS.max_tokens)


def test_steps_beyond_the_kernel_rows_without_packed_weights_run_the_layers(monkeypatch, checkpoint_dir,
                                                                            hf_greedy):
    """Without packed weights, more than `kernel_rows` rows go to F.linear: the stack leaves those
    steps (the prefills here) to the model and serves the decodes."""
    monkeypatch.setenv(ENV_PACK, "0")
    path = checkpoint_dir("llama")
    llm = LLM(path, num_kv_blocks=64)
    stack = model_of(llm).decoder_stack
    assert not stack.has_gemm and stack.kernel_rows == 16
    rows = record_rows(stack)
    got = run(llm, [PROMPTS])
    assert rows and max(rows) <= 16 and 4 in rows
    for prompt, (tokens, _) in zip(PROMPTS, got):
        assert tokens == hf_greedy(path, prompt, PARAMS.max_tokens)


def test_a_position_outside_the_rotary_table_is_an_error(checkpoint_dir):
    """As the layers' rotary says it, before the stack writes anything (a step's arguments
    replayed with the position one past the table)."""
    llm = LLM(checkpoint_dir("llama"), num_kv_blocks=64)
    model = model_of(llm)
    stack, steps = model.decoder_stack, []
    model.decoder_stack = lambda *args: steps.append(args) or stack(*args)
    run(llm, [PROMPTS[:1]])
    positions, hidden, residual, caches, metadata = steps[-1]  # a decode
    before = [c.clone() for c in caches]
    with pytest.raises(IndexError, match=f"outside the rotary table \\({stack.max_position} positions"):
        stack(torch.full_like(positions, stack.max_position), hidden, residual, caches, metadata)
    assert all(torch.equal(a, b) for a, b in zip(before, caches))


@pytest.mark.parametrize("why", ["switched off", "TORCH_SDPA", "tensor parallel"])
def test_what_the_stack_leaves_to_the_model(monkeypatch, checkpoint_dir, hf_greedy, why):
    path = checkpoint_dir("llama")
    kwargs = {}
    if why == "switched off":
        monkeypatch.setenv(ENV_STACK, "0")
    elif why == "TORCH_SDPA":
        kwargs["attention_backend"] = "TORCH_SDPA"
    llm = LLM(path, num_kv_blocks=64, **kwargs)
    model = model_of(llm)
    specs = model.decoder_layer_specs()
    reason = unsupported(build.load(), specs, llm.llm_engine.attn_backend.name)
    if why == "tensor parallel":
        assert reason is None and model.decoder_stack is not None
        monkeypatch.setattr(ps, "get_tp_size", lambda: 2)
        assert model.decoder_layer_specs() is None  # o_proj and down_proj reduce across ranks
        return
    assert model.decoder_stack is None
    assert reason == {"switched off": f"switched off ({ENV_STACK}=0)",
                      "TORCH_SDPA": "attention is TORCH_SDPA, not CPU_PAGED"}[why]
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=5,
                                                                       ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(path, PROMPTS[0], 5)


@pytest.mark.parametrize("arch,file_type", [("qwen2", "q4_0"), ("qwen2", "q8_0"), ("qwen3_norms", "q4_k_m")])
def test_quantized_layers_run_in_the_stack_bit_for_bit(isa_level, checkpoint_dir, tmp_path, arch, file_type):
    """A GGUF file whose products run on CPU formats (Q4_0, Q8_0; qwen2: q/k/v biases; qwen3:
    its head norms, and Q4_K beside Q6_K) runs through the stack (omni_qlinear at every row
    count, prefills too), to the last bit the quantised layers one by one."""
    pytest.importorskip("gguf")
    from omniinfer.benchmarks.gguf_export import export

    path = export(checkpoint_dir(arch), str(tmp_path / f"m-{file_type}.gguf"), file_type)
    llm = LLM(path, num_kv_blocks=64)
    try:
        stack = model_of(llm).decoder_stack
        assert isinstance(stack, CpuDecoderStack)
        rows = record_rows(stack)
        batches = [PROMPTS[:1], PROMPTS]
        got = run(llm, batches)
        assert max(rows) >= 20 and 1 in rows and 4 in rows
        model_of(llm).decoder_stack = None
        assert run(llm, batches) == got
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fp8_layers_run_in_the_stack_bit_for_bit(isa_level, tmp_path, dtype):
    """An FP8 checkpoint's products run in the stack: every step in float32, and without bfloat16
    hardware; in bfloat16 with it the steps of up to F8_PANEL_ROWS tokens (a prefill's products
    decode the weight for torch's matmul, layer by layer), to the last bit the layers one by one."""
    from omniinfer.testing.quant_checkpoints import Scheme, write_quantized
    from omniinfer.testing.tiny_models import build_tiny_checkpoint
    from omniinfer_cpu.quant import fp8_prefill_rows

    float_dir = build_tiny_checkpoint(str(tmp_path / "float"), "qwen2", dtype=dtype, hidden_size=256,
                                      intermediate_size=512, vocab_size=1000, seed=3)
    path = write_quantized(float_dir, str(tmp_path / "fp8"), Scheme("fp8", block=(128, 128)))
    with LLM(path, num_kv_blocks=64) as llm:
        stack = model_of(llm).decoder_stack
        assert isinstance(stack, CpuDecoderStack)
        assert {k.code for m in model_of(llm).modules() for _, k in getattr(m, "quant_kernels", [])} == {21}
        rows = record_rows(stack)
        batches = [PROMPTS[:1], PROMPTS]
        got = run(llm, batches)
        assert 1 in rows and 4 in rows
        most = fp8_prefill_rows(getattr(torch, dtype))
        assert max(rows) <= most if most < 20 else max(rows) >= 20
        model_of(llm).decoder_stack = None
        assert run(llm, batches) == got


MOE = {"qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True),
       "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=256)}


def near(got, want, atol=1e-5):
    """The same tokens, and log-probabilities within atol (the router's softmax is computed in C:
    its probabilities a few ulps from torch's; measured: 1.2e-6 at most)."""
    assert [g[0] for g in got] == [w[0] for w in want]
    for g, w in zip(got, want):
        for lg, lw in zip(g[1], w[1]):
            assert [t for t, _ in lg] == [t for t, _ in lw]
            assert max(abs(a - b) for (_, a), (_, b) in zip(lg, lw)) <= atol, (lg, lw)


@pytest.mark.parametrize("arch,file_type,activations", [("qwen3_moe", "q4_k_m", "int8"), ("mixtral", "q4_0", "int8"),
                                                        ("qwen3_moe", "q8_0", "float")])
def test_sparse_layers_run_in_the_stack(isa_level, monkeypatch, tmp_path, arch, file_type, activations):
    """A mixture of experts' GGUF file (Qwen3-MoE: head norms too; Mixtral): its sparse layers'
    router, softmax top-k and quantised experts (omni_qmoe, omni_qmoe_tokens) inside the stack, as
    the layers one by one compute them up to the router's softmax; with int8 activations prefills
    and batched decodes too (one call for a chunk), with float ones single-token steps only."""
    pytest.importorskip("gguf")
    from omniinfer.benchmarks.gguf_export import export
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", activations)
    model = build_tiny_checkpoint(str(tmp_path / arch), arch, hidden_size=256, vocab_size=1000, seed=2,
                                  norm_jitter=0.2, **MOE[arch])
    llm = LLM(export(model, str(tmp_path / f"{arch}.gguf"), file_type), num_kv_blocks=64)
    try:
        stack = model_of(llm).decoder_stack
        assert isinstance(stack, CpuDecoderStack) and stack.chunks == (activations == "int8")
        rows = record_rows(stack)
        batches = [PROMPTS[:1], PROMPTS]
        got = run(llm, batches)
        assert 1 in rows and (max(rows) >= 20) == (activations == "int8")
        model_of(llm).decoder_stack = None
        near(got, run(llm, batches))
    finally:
        llm.shutdown()


def test_what_the_stack_leaves_of_a_mixture_of_experts(checkpoint_dir):
    """Qwen2-MoE's shared expert is no part of the spec: its layers run one by one; a float
    checkpoint's experts (omni_moe, the torch reference) are not the quantised step."""
    from omniinfer.models.qwen2_moe import Qwen2MoeForCausalLM

    llm = LLM(checkpoint_dir("qwen2_moe"), num_kv_blocks=64)
    model = model_of(llm)
    assert model.decoder_stack is None and model.decoder_layer_specs() is None
    assert "shared expert" in Qwen2MoeForCausalLM.decoder_stack_refusal()
    llm = LLM(checkpoint_dir("qwen3_moe"), num_kv_blocks=64)
    specs = model_of(llm).decoder_layer_specs()
    assert model_of(llm).decoder_stack is None and any(s.experts is not None for s in specs)
    assert unsupported(build.load(), specs, "CPU_PAGED") == ("experts that do not run on the CPU's quantised "
                                                            "one-call step (float or reference experts)")
