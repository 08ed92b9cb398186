"""GPTQ, AWQ, compressed-tensors and FP8 checkpoints end to end: every layer format loads into the
quantisation contract and generates what transformers generates on the float weights the
quantised ones stand for (their exact values; transformers cannot load these formats here without
their CUDA packages), with chunked prefill and tensor parallelism; the symmetric ones take the CPU
plugin's kernel, the others the reference; bad configs are clear errors. The comparisons to 1e-4
run the CPU kernels with float activations; their default, activations rounded to int8 blocks, is
held to the tolerance that rounding allows (INT8_LOGPROB_TOL)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from omniinfer import LLM, SamplingParams
from omniinfer.testing.greedy import agreed_steps, kernel_names
from omniinfer.testing.quant_checkpoints import Scheme, write_quantized
from omniinfer.testing.tiny_models import build_tiny_checkpoint

PROMPTS = [[1, 5, 9, 33, 7, 20], list(range(40, 75))]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("intq")
    return build_tiny_checkpoint(str(root / "float"), "qwen2", hidden_size=256, intermediate_size=512,
                                 vocab_size=1000, seed=5)


def checkpoint(float_model, scheme: Scheme) -> tuple[str, str]:
    root = os.path.dirname(float_model)
    out, ref = os.path.join(root, scheme.label), os.path.join(root, scheme.label + "-ref")
    if not os.path.isdir(out):
        write_quantized(float_model, out, scheme, ref)
    return out, ref


def run(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
            for o in outs]


def hf_run(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    got = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=PARAMS.max_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            tokens = out.sequences[0, len(prompt):].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens)]
            got.append((tokens, logprobs))
    return got


def assert_transformers_run(got, ref: str, label: str) -> None:
    """`got` (run's) has transformers' tokens on `ref`, and its log-probs within 1e-4."""
    for (tokens, logprobs), (want, want_lp) in zip(got, hf_run(ref)):
        assert tokens == want, label
        assert max(abs(a - b) for a, b in zip(logprobs, want_lp)) < 1e-4, label


def choices(llm) -> set[tuple[str, str]]:
    model = llm.llm_engine.executor.worker.model_runner.model
    return {(kind, kernel.split(" ")[0]) for m in model.modules()
            for kind, kernel, _ in getattr(m, "quant_choices", [])}


SCHEMES = [
    (Scheme("gptq", 4, 128, sym=True), "cpu"),
    (Scheme("gptq", 4, -1, sym=True), "cpu"),
    (Scheme("gptq", 8, 32, sym=True), "cpu"),
    (Scheme("gptq", 8, 32, sym=False), "reference"),
    (Scheme("gptq", 4, 64, sym=False, act_order=True), "reference"),
    (Scheme("gptq", 4, 128, sym=False, v1=False), "reference"),
    (Scheme("awq", 4, 128, sym=False), "reference"),
    (Scheme("awq", 4, 32, sym=False), "reference"),
    (Scheme("ct", 4, 128, sym=True), "cpu"),
    (Scheme("ct", 4, 32, sym=False, act_order=True), "reference"),
    (Scheme("ct", 8, -1, sym=True), "cpu"),
    (Scheme("ct-w8a8", 8, -1), "cpu"),
    (Scheme("ct-w8a8", 8, -1, static=True), "cpu"),
    (Scheme("fp8", block=(128, 128)), "cpu"),
    (Scheme("fp8"), "cpu"),
    (Scheme("ct-fp8", block=(128, 128)), "cpu"),
    (Scheme("ct-fp8", group_size=-1), "cpu"),
    (Scheme("ct-fp8"), "cpu"),
]


@pytest.mark.parametrize("scheme,kernel", SCHEMES, ids=[s.label for s, _ in SCHEMES])
def test_quantized_checkpoint_equals_transformers_on_its_values(float_model, scheme, kernel, monkeypatch):
    """The second prompt's 35 tokens go in chunks of 16; both decode together."""
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    path, ref = checkpoint(float_model, scheme)
    llm = LLM(path, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        want_method = "compressed-tensors" if scheme.method.startswith("ct") else scheme.method
        assert llm.llm_engine.config.model.quantization == want_method
        model = llm.llm_engine.executor.worker.model_runner.model
        layers = [m for m in model.modules() if getattr(m, "qweight", None) is not None]
        assert len(layers) == 2 * 4 and all(m.weight.is_meta for m in layers)  # qkv, o, gate_up, down
        assert {k for _, k in choices(llm)} == {kernel}, choices(llm)
        got = run(llm)
    finally:
        llm.shutdown()
    assert_transformers_run(got, ref, scheme.label)


# The CPU kernels round each block of 32 activations to int8 (decode rows; Q4_0/Q8_0-shaped
# weights at every row count): an error of up to 1/254 of the block's largest value per element,
# through every layer; these tiny models (initializer_range 0.1) move a chosen token's log-prob by
# up to ~0.14 (measured), so a step whose two best tokens are nearer than NEAR_TIE
# (omniinfer.testing.greedy) may go either way.
INT8_LOGPROB_TOL = 0.3


def hf_scores(path: str) -> list[list[torch.Tensor]]:
    """transformers' log-probs at each greedy step of each prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return [[torch.log_softmax(s[0].float(), -1) for s in model.generate(
            torch.tensor([p]), max_new_tokens=PARAMS.max_tokens, do_sample=False, output_scores=True,
            return_dict_in_generate=True).scores] for p in PROMPTS]


@pytest.mark.parametrize("scheme", [Scheme("gptq", 4, 128, sym=True), Scheme("gptq", 8, 32, sym=True),
                                    Scheme("ct-w8a8", 8, -1)], ids=lambda s: s.label)
def test_int8_activations_keep_transformers_tokens(float_model, scheme, monkeypatch):
    """Greedy tokens equal transformers' on the float values until a near-tie (where ours must be
    the other of transformers' two best), the log-probs up to there within INT8_LOGPROB_TOL, and
    the rounding visible (the int8 path ran)."""
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "int8")
    path, ref = checkpoint(float_model, scheme)
    llm = LLM(path, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        kernels = kernel_names(llm)
        assert all(k.endswith("int8 activations)") for k in kernels), kernels
        got = run(llm)
    finally:
        llm.shutdown()
    worst = 0.0
    for (tokens, logprobs), steps in zip(got, hf_scores(ref)):
        n = agreed_steps(tokens, steps)
        worst = max([worst] + [abs(lp - float(steps[i][tokens[i]])) for i, lp in enumerate(logprobs[:n])])
    assert 1e-5 < worst < INT8_LOGPROB_TOL, (scheme.label, worst)


@pytest.mark.parametrize("scheme", [Scheme("gptq", 4, 128, sym=False, act_order=True),
                                    Scheme("awq", 4, 128, sym=False), Scheme("ct", 4, 128, sym=True),
                                    Scheme("fp8", block=(128, 128)), Scheme("ct-fp8", group_size=-1)],
                         ids=lambda s: s.label)
def test_quantized_checkpoint_under_tensor_parallelism(float_model, scheme):
    """Column-parallel layers split outputs, row-parallel ones inputs (on group boundaries; with
    act-order every rank keeps every group; FP8 on its scale blocks)."""
    path, _ = checkpoint(float_model, scheme)
    single = LLM(path, num_kv_blocks=64)
    try:
        want = [t for t, _ in run(single)]
    finally:
        single.shutdown()
    llm = LLM(path, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert [t for t, _ in run(llm)] == want
    finally:
        llm.shutdown()


def test_quantized_weights_hold_their_bytes_only(float_model):
    """A GPTQ int4 model holds its packed codes and scales once, not a float copy: the CPU
    kernel's repack (as Q4_0 blocks, a float16 scale per 32 codes, in groups of 8 rows) replaces
    the checkpoint's tensors in the layer, and the kernel reads the layer's bytes."""
    path, _ = checkpoint(float_model, Scheme("gptq", 4, 128, sym=True))
    llm = LLM(path, num_kv_blocks=64)
    try:
        model = llm.llm_engine.executor.worker.model_runner.model
        for m in model.modules():
            if getattr(m, "qweight", None) is None:
                continue
            rows, cols = m.qweight.shape
            assert m.qweight.nbytes <= rows * cols // 2 + rows * cols // 32 * 2, m
            held = {t.data_ptr() for s in m.qweight.segments for t in s.piece.tensors.values()}
            assert all(k.w.data_ptr() in held for _, k in m.quant_kernels), m
    finally:
        llm.shutdown()


def test_fp8_weights_hold_their_bytes_only(float_model):
    """An FP8 model holds the file's e4m3 bytes (the kernel reads them where they are) and its
    scales, a float32 per 128 x 128 block spread over the rows (1/32 of the bytes): no float copy."""
    path, _ = checkpoint(float_model, Scheme("fp8", block=(128, 128)))
    with LLM(path, num_kv_blocks=64) as llm:
        model = llm.llm_engine.executor.worker.model_runner.model
        layers = [m for m in model.modules() if getattr(m, "qweight", None) is not None]
        assert len(layers) == 8
        for m in layers:
            rows, cols = m.qweight.shape
            assert m.weight.is_meta and m.qweight.nbytes == rows * cols + rows * cols // 128 * 4, m
            held = {t.data_ptr() for s in m.qweight.segments for t in s.piece.tensors.values()}
            assert all(k.w.data_ptr() in held and k.scale.data_ptr() in held for _, k in m.quant_kernels), m


def test_an_fp8_checkpoint_equals_transformers_loading_it(float_model):
    """transformers reads the same FP8 files itself (its fine-grained FP8 support dequantises them
    on a machine without an FP8 GPU): the same tokens, log-probs within 1e-4."""
    pytest.importorskip("accelerate")  # (transformers' FP8 loading needs it)
    path, _ = checkpoint(float_model, Scheme("fp8", block=(128, 128)))
    with LLM(path, num_kv_blocks=64) as llm:
        got = run(llm)
    assert_transformers_run(got, path, "fp8 files, read by transformers")


def test_fp8_at_load(float_model):
    """quantization="fp8" on a float checkpoint (vLLM's --quantization fp8): every linear layer as
    e4m3 codes with a scale per output channel, on the CPU kernel; the embedding and LM head float;
    transformers' tokens, log-probs within 1e-4, on the weights those codes stand for."""
    from transformers import AutoModelForCausalLM

    from omniinfer.quantization import fp8
    from omniinfer.quantization.base import dequantize_piece

    with LLM(float_model, num_kv_blocks=64, quantization="fp8") as llm:
        assert llm.llm_engine.config.model.quantization == "fp8"
        assert choices(llm) == {("fp8", "cpu")}
        model = llm.llm_engine.executor.worker.model_runner.model
        assert model.lm_head.qweight is None and not model.lm_head.weight.is_meta
        got = run(llm)
    ref = AutoModelForCausalLM.from_pretrained(float_model, dtype=torch.float32)
    with torch.no_grad():
        for name, module in ref.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(dequantize_piece(fp8.quantize(module.weight)))
        for (tokens, logprobs), prompt in zip(got, PROMPTS):
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=PARAMS.max_tokens, do_sample=False,
                               output_scores=True, return_dict_in_generate=True)
            assert tokens == out.sequences[0, len(prompt):].tolist()
            want = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, tokens)]
            assert max(abs(a - b) for a, b in zip(logprobs, want)) < 1e-4


def test_an_fp8_checkpoint_with_kv_cache_scales_loads(float_model, tmp_path):
    """FP8-KV checkpoints also hold attention's scales for an fp8 KV cache (`self_attn.k_scale`,
    older ones `k_proj.output_scale`); the cache here is the model's dtype, so they are left
    unread (as vLLM does with kv_cache_dtype 'auto'): the same tokens as without them."""
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint(float_model, Scheme("fp8"))
    edited = str(tmp_path / "fp8-kv")
    shutil.copytree(path, edited)
    state = load_file(os.path.join(edited, "model.safetensors"))
    for i in range(2):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.5)
        state[f"model.layers.{i}.self_attn.k_proj.output_scale"] = torch.tensor([0.5])
    save_file(state, os.path.join(edited, "model.safetensors"), metadata={"format": "pt"})
    with LLM(path, num_kv_blocks=64) as llm:
        want = run(llm)
    with LLM(edited, num_kv_blocks=64) as llm:
        assert run(llm) == want


@pytest.mark.parametrize("keep_scales", [True, False])
def test_fp8_codes_without_a_quantization_config_are_refused(float_model, tmp_path, keep_scales):
    """An FP8 checkpoint whose config.json lost its quantization_config: the load fails naming the
    first e4m3 weight and why (with its scales still in the file the error was theirs, "does not
    belong"; without them the codes loaded as float weights, a model of wrong numbers, silently)."""
    from safetensors.torch import load_file, save_file

    path, _ = checkpoint(float_model, Scheme("fp8", block=(128, 128)))
    stripped = tmp_path / "stripped"
    shutil.copytree(path, stripped)
    config = json.loads((stripped / "config.json").read_text())
    del config["quantization_config"]
    (stripped / "config.json").write_text(json.dumps(config))
    if not keep_scales:
        state = load_file(str(stripped / "model.safetensors"))
        save_file({k: v for k, v in state.items() if not k.endswith("weight_scale_inv")},
                  str(stripped / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"tensor 'model\.layers\.0\..*\.weight' in .*model\.safetensors: .*"
                                        r"torch\.float8_e4m3fn codes, which need a scale.*quantization_config"):
        LLM(str(stripped), num_kv_blocks=64)


def test_an_fp8_scale_of_the_wrong_shape_is_named(float_model, tmp_path):
    """A config whose block size does not match the scales the file holds fails at load, naming
    the layer, the shape found and the shape expected."""
    path, _ = checkpoint(float_model, Scheme("fp8", block=(128, 128)))
    edited = _with_config(float_model, tmp_path, {"quant_method": "fp8", "weight_block_size": [64, 128]}, path)
    with pytest.raises(ValueError, match=r"model\.layers\.0\..*\(fp8, \d+x\d+\): its scale has shape "
                                         r"\(\d+, \d+\); expected shape \(\d+, \d+\)"):
        LLM(edited, num_kv_blocks=64)


def _with_config(float_model, tmp_path, qconfig, path: str | None = None) -> str:
    if path is None:
        path, _ = checkpoint(float_model, Scheme("gptq", 4, 128, sym=True))
    out = tmp_path / "edited"
    out.mkdir()
    for name in os.listdir(path):
        os.symlink(os.path.join(path, name), out / name)
    os.unlink(out / "config.json")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = qconfig
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize("qconfig,match", [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"gptq.*bits=3 is not supported; supported: \(4, 8\)"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, r"group_size=100 is not supported"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"version='gemv' is not supported"),
    ({"quant_method": "bitsandbytes"}, r"quant_method='bitsandbytes'.*does not load"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, r"\(fp8\): fmt='e5m2' is not supported; supported: \('e4m3',\)"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\] is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, r"scale_fmt='ue8m0'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16}}}},
     r"weights\.\(type, num_bits\)=\('float', 4\) is not supported"),
])
def test_unsupported_quantization_configs_are_named(float_model, tmp_path, qconfig, match):
    with pytest.raises(ValueError, match=match):
        LLM(_with_config(float_model, tmp_path, qconfig), num_kv_blocks=64)


def test_quantization_argument_must_match_the_checkpoint(float_model):
    path, _ = checkpoint(float_model, Scheme("awq", 4, 128, sym=False))
    with pytest.raises(ValueError, match=r"quantization='gptq'.*quantised with 'awq'"):
        LLM(path, num_kv_blocks=64, quantization="gptq")
    with pytest.raises(ValueError, match=r"quantization='awq'.*no quantization_config.*'int8' or 'fp8' quantises"):
        LLM(float_model, num_kv_blocks=64, quantization="awq")
    fp8_path, _ = checkpoint(float_model, Scheme("fp8", block=(128, 128)))
    with pytest.raises(ValueError, match=r"quantization='int8'.*quantised with 'fp8'"):
        LLM(fp8_path, num_kv_blocks=64, quantization="int8")


@pytest.mark.parametrize("scheme", [Scheme("gptq", 4, 64, sym=False, act_order=True), Scheme("awq", 4, 32, sym=False),
                                    Scheme("ct", 8, -1, sym=True), Scheme("ct-w8a8", 8, -1),
                                    Scheme("ct-w8a8", 8, -1, static=True), Scheme("fp8", block=(128, 128)),
                                    Scheme("ct-fp8", group_size=-1)], ids=lambda s: s.label)
def test_the_triton_kernel_runs_each_piece_as_the_reference(scheme):
    """The GPU plugins' kernel (interpreted here) on the pieces the loader makes, a decode-sized
    and a prefill-sized batch; W8A8 quantises its activations as the torch reference does."""
    pytest.importorskip("triton")
    from omniinfer.quantization import int_reference
    from omniinfer.quantization.base import ReferenceKernel
    from omniinfer.quantization.int_pieces import int8_weight
    from omniinfer.quantization.triton_kernel import TritonQuantKernel
    from omniinfer.testing.quant_checkpoints import _layer

    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.1
    tensors, _ = _layer(weight, scheme, seed=1)
    from omniinfer.quantization.int_formats import parse_quantization_config
    from omniinfer.quantization.int_pieces import IntCheckpointTensor, _features, _Read

    fmt = parse_quantization_config(scheme.config()).layer_format("model.layers.0.mlp.up_proj")
    parts = {k: _Read(v) for k, v in tensors.items()}
    piece = IntCheckpointTensor("up.weight", fmt, parts, _features(fmt, parts)).full()
    assert TritonQuantKernel.kinds.count(piece.kind) == 1
    kernel = TritonQuantKernel(piece)
    for rows in (1, 20):
        x = torch.randn(rows, 128)
        got = kernel.apply(x)
        if piece.kind.startswith("w8a8"):
            want = int_reference.int8_linear_reference(x, int8_weight(piece))
        else:
            want = ReferenceKernel(piece).apply(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("intq_moe")
    return build_tiny_checkpoint(str(root / "float"), "qwen3_moe", hidden_size=256, intermediate_size=256, seed=2,
                                 num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                 norm_topk_prob=True)


@pytest.mark.parametrize("scheme,kernel", [(Scheme("gptq", 4, 128, sym=True), "cpu"),
                                           (Scheme("awq", 4, 128, sym=False), "reference"),
                                           (Scheme("ct", 8, -1, sym=True), "cpu"),
                                           (Scheme("fp8", block=(128, 128)), "cpu")],
                         ids=lambda s: getattr(s, "label", s))
@pytest.mark.parametrize("tp", [1, 2])
def test_a_quantized_moe_checkpoint_keeps_its_experts_quantized(moe_model, scheme, kernel, tp, monkeypatch):
    """A Qwen3-MoE checkpoint whose experts' gate/up/down are quantised (the router stays float):
    each expert is its own quantised weight in the MoE layer (no float stack), run by the format's
    kernel; transformers' tokens on the values they stand for, one rank or two."""
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    path, ref = checkpoint(moe_model, scheme)
    llm = LLM(path, num_kv_blocks=64, tensor_parallel_size=tp)
    try:
        if tp == 1:
            experts = llm.llm_engine.executor.worker.model_runner.model.model.layers["0"].mlp.experts
            assert experts.w13_weight.is_meta and len(experts.qexperts.w13) == 8
            assert {k.split(" ")[0] for _, k, _ in experts.quant_choices} == {kernel}
        got = run(llm)
    finally:
        llm.shutdown()
    assert_transformers_run(got, ref, scheme.label)


def test_a_quantized_checkpoint_in_pytorch_bin_files(float_model, tmp_path):
    """AutoGPTQ-era checkpoints may hold their packed weights in .bin files: the same tokens as
    the safetensors copy, on one rank and under tensor parallelism."""
    from safetensors.torch import load_file

    path, _ = checkpoint(float_model, Scheme("gptq", 4, 128, sym=False, act_order=True))
    as_bin = str(tmp_path / "bin")
    shutil.copytree(path, as_bin)
    for name in os.listdir(as_bin):
        if name.endswith(".safetensors"):
            torch.save(load_file(os.path.join(as_bin, name)), os.path.join(as_bin, "pytorch_model.bin"))
            os.remove(os.path.join(as_bin, name))
    assert os.listdir(as_bin).count("pytorch_model.bin") == 1 and not any(
        n.endswith(".safetensors") or n.endswith(".index.json") for n in os.listdir(as_bin))
    with LLM(path, num_kv_blocks=64) as llm:
        want = [t for t, _ in run(llm)]
    for tp in (1, 2):
        with LLM(as_bin, num_kv_blocks=64, tensor_parallel_size=tp) as llm:
            assert [t for t, _ in run(llm)] == want
