"""Files llama.cpp's own quantiser writes (`llama-quantize`, from an F16 GGUF of a tiny random
model): the benchmark exporter gives every tensor the type llama.cpp gives it, and omniinfer
serves those files (llama.cpp's scale search, not our round-to-nearest) with transformers'
greedy tokens on the same file. Needs llama.cpp's tools ($LLAMA_CPP_BIN or PATH): skipped,
saying so, where they are not (CI has none; see docs/quantization.md for building them)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

gguf = pytest.importorskip("gguf")

from test_quantization import NEARLY, PROMPTS, hf_greedy_gguf, run  # noqa: E402

from omniinfer import LLM  # noqa: E402
from omniinfer.benchmarks.gguf_export import export, tensor_type  # noqa: E402
from omniinfer.benchmarks.perf import SkippedRun  # noqa: E402
from omniinfer.testing.greedy import agreed_steps  # noqa: E402
from omniinfer.testing.tiny_models import build_tiny_checkpoint  # noqa: E402

try:
    from omniinfer.benchmarks.llama_cpp import tool

    QUANTIZE = tool("llama-quantize")
except SkippedRun as e:
    pytest.skip(f"llama.cpp's quantiser is absent: {e}", allow_module_level=True)

FILE_TYPES = {"q3_k_m": "Q3_K_M", "q2_k": "Q2_K", "iq4_xs": "IQ4_XS", "iq4_nl": "IQ4_NL",
              "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M"}
SHAPES = {  # 16 layers for the n_layer/16 and /8 rules, 4 query heads a KV head; a narrow tied one
    "wide": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=8,
                 num_key_value_heads=2),
    "narrow": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """(shape, file type) -> (llama.cpp's file, the checkpoint's config)."""
    root = tmp_path_factory.mktemp("llama_cpp")
    files = {}
    for shape, kw in SHAPES.items():
        ckpt = build_tiny_checkpoint(str(root / shape), "qwen2", vocab_size=1024, seed=1, **kw)
        f16 = export(ckpt, str(root / f"{shape}-f16.gguf"), "f16")
        with open(os.path.join(ckpt, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        for file_type, out in quantize(f16, str(root / shape), FILE_TYPES).items():
            files[shape, file_type] = out, cfg
    return files


def quantize(f16: str, prefix: str, types: dict[str, str]) -> dict[str, str]:
    """llama-quantize's file of each type (ours -> llama.cpp's name) from `f16`, at `prefix`-TYPE.gguf."""
    out = {}
    for file_type, name in types.items():
        out[file_type] = f"{prefix}-{file_type}.gguf"
        subprocess.run([QUANTIZE, f16, out[file_type], name], check=True, capture_output=True, timeout=600)
    return out


@pytest.mark.parametrize("file_type", sorted(FILE_TYPES))
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_exporter_types_tensors_as_llama_cpp_does(quantized, shape, file_type):
    path, cfg = quantized[shape, file_type]
    gqa = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    for t in gguf.GGUFReader(path).tensors:
        if len(t.shape) == 2:
            ours = tensor_type(t.name, file_type, int(t.shape[0]), cfg["num_hidden_layers"],
                               bool(cfg.get("tie_word_embeddings")), gqa)
            assert ours == gguf.GGMLQuantizationType(t.tensor_type).name, t.name


# The 16-layer random model moves its log-probs by 0.2-1.0 under any 8-bit rounding (measured: int8
# activations on its q4_k_m file, Q2_K requantised to Q8_0), past NEAR_TIE; the near rewrites'
# bounds are checked block by block (tests/test_gguf_transcode.py), and on the shallow model here.
CASES = [(shape, t) for shape in sorted(SHAPES) for t in ("q3_k_m", "q2_k", "iq4_xs", "iq4_nl")
         if not (shape == "wide" and t == "q2_k")]


@pytest.mark.parametrize("shape,file_type", CASES)
def test_llama_cpps_files_follow_transformers(quantized, shape, file_type, monkeypatch):
    """Float activations: the CPU kernels compute the file's weights up to float32 sums (Q3_K and
    IQ4_NL rewritten exactly as Q6_K and Q8_0): equal tokens; IQ4_XS and Q2_K, held as near Q8_0
    blocks, equal up to a near-tie."""
    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    path, _ = quantized[shape, file_type]
    llm = LLM(path, num_kv_blocks=64)
    try:
        got = run(llm)
    finally:
        llm.shutdown()
    for prompt, tokens in zip(PROMPTS, got):
        if file_type in NEARLY:
            agreed_steps(tokens, hf_greedy_gguf(path, prompt, len(tokens), scores=True)[1])
        else:
            assert tokens == hf_greedy_gguf(path, prompt, len(tokens)), (shape, file_type)


# mixture-of-experts files: Qwen3-MoE's and Mixtral's (8 experts: llama.cpp's rules for them)
MOE_TYPES = {"q4_k_m": "Q4_K_M", "q3_k_m": "Q3_K_M", "q4_0": "Q4_0"}


@pytest.fixture(scope="module")
def moe_quantized(tmp_path_factory):
    """(arch, file type) -> (llama.cpp's file, the checkpoint)."""
    from test_gguf_moe import COMMON, FAMILIES

    root = tmp_path_factory.mktemp("llama_cpp_moe")
    files = {}
    for arch in ("qwen3_moe", "mixtral"):
        ckpt = build_tiny_checkpoint(str(root / arch), arch, **COMMON, **FAMILIES[arch])
        f16 = export(ckpt, str(root / f"{arch}-f16.gguf"), "f16")
        for file_type, out in quantize(f16, str(root / arch), MOE_TYPES).items():
            files[arch, file_type] = out, ckpt
    return files


@pytest.mark.parametrize("file_type", sorted(MOE_TYPES))
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_exporter_types_experts_as_llama_cpp_does(moe_quantized, arch, file_type):
    path, ckpt = moe_quantized[arch, file_type]
    with open(os.path.join(ckpt, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    gqa = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    for t in gguf.GGUFReader(path).tensors:
        if len(t.shape) >= 2:
            ours = tensor_type(t.name, file_type, int(t.shape[0]), cfg["num_hidden_layers"], False, gqa, experts)
            assert ours == gguf.GGMLQuantizationType(t.tensor_type).name, t.name


@pytest.mark.parametrize("file_type", sorted(MOE_TYPES))
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_llama_cpps_moe_files_follow_transformers(moe_quantized, arch, file_type, monkeypatch, tmp_path):
    """Float activations: the experts' kernels compute the file's weights (llama.cpp's scale search)
    as transformers does on the `gguf` package's dequantisation of them: the same tokens."""
    from omniinfer.testing.greedy import dequantized_checkpoint, hf_greedy

    monkeypatch.setenv("OMNIINFER_CPU_QUANT_ACTIVATIONS", "float")
    path, ckpt = moe_quantized[arch, file_type]
    llm = LLM(path, tokenizer=ckpt, num_kv_blocks=64)
    try:
        got = run(llm)
    finally:
        llm.shutdown()
    want = hf_greedy(dequantized_checkpoint(path, ckpt, str(tmp_path / "ref")), PROMPTS, len(got[0]))
    assert got == [tokens for tokens, _ in want]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2"])
def test_a_qwen_files_tokenizer_encodes_as_llama_cpp(arch, tmp_path):
    """The tokenizer built from a Qwen file (its "qwen2" pre-tokenizer: digits one by one) gives
    the ids `llama-tokenize` gives on the same file."""
    from test_gguf_moe import COMMON, FAMILIES

    from omniinfer.quantization.gguf_tokenizer import load_tokenizer

    try:
        tokenize = tool("llama-tokenize")
    except SkippedRun as e:
        pytest.skip(f"llama.cpp's tokenizer tool is absent: {e}")
    ckpt = build_tiny_checkpoint(str(tmp_path / arch), arch, **COMMON, **FAMILIES.get(arch, {}))
    path = export(ckpt, str(tmp_path / "q8_0.gguf"), "q8_0")
    text = "Blocks of tokens are shared by reference count: 0123 + 45 = ?"
    out = subprocess.run([tokenize, "-m", path, "-p", text, "--ids", "--no-bos", "--log-disable"],
                         capture_output=True, text=True, check=True, timeout=120,
                         env=dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(tokenize)))
    assert load_tokenizer(path).encode(text) == json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch", ["llama", "mistral", "phi3", "gemma2"])
def test_a_sentencepiece_files_tokenizer_encodes_as_llama_cpp(tmp_path, arch):
    """A file with a SentencePiece vocabulary (Llama 2's kind: build_sentencepiece_tokenizer):
    `llama-tokenize` and the tokenizer built from the file give the same ids, BOS, the space
    llama.cpp puts before the text and after each special token (none for Gemma, whose files
    say add_space_prefix false), and byte fallback included."""
    from test_gguf_header import SPECIAL_TEXTS, SPM_TEXTS

    from omniinfer.quantization.gguf_tokenizer import load_tokenizer

    try:
        tokenize = tool("llama-tokenize")
    except SkippedRun as e:
        pytest.skip(f"llama.cpp's tokenizer tool is absent: {e}")
    ckpt = build_tiny_checkpoint(str(tmp_path / "ckpt"), arch, tokenizer="sentencepiece", seed=3)
    os.makedirs(tmp_path / "file")
    path = export(ckpt, str(tmp_path / "file" / "q8_0.gguf"), "q8_0")
    ours = load_tokenizer(path)
    for text in [t for t in SPM_TEXTS if t] + SPECIAL_TEXTS:
        out = subprocess.run([tokenize, "-m", path, "-p", text, "--ids", "--log-disable"],
                             capture_output=True, text=True, check=True, timeout=120,
                             env=dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(tokenize)))
        assert ours.encode(text) == json.loads(out.stdout.strip().splitlines()[-1]), text


@pytest.mark.parametrize("arch, add_bos, pre", [
    ("llama", True, None), ("llama", False, None), ("llama", None, None), ("llama", None, "llama-bpe"),
    ("qwen2", True, None), ("qwen2", None, None), ("gemma2", True, None), ("gemma2", None, None),
])
def test_a_prompt_starts_with_bos_as_llama_cpp_starts_it(tmp_path, monkeypatch, arch, add_bos, pre):
    """`llama-tokenize` with its BOS rules (the file's add_bos_token, else its default for the
    vocabulary) gives the ids of the tokenizer built from the same file, BOS and all."""
    from test_gguf_header import tokenizer_file

    from omniinfer.quantization.gguf_tokenizer import load_tokenizer

    try:
        tokenize = tool("llama-tokenize")
    except SkippedRun as e:
        pytest.skip(f"llama.cpp's tokenizer tool is absent: {e}")
    path = tokenizer_file(tmp_path, arch, add_bos, pre, monkeypatch)
    text = "Hello there world"  # (the exporter's "default" pre-tokenizer is llama.cpp's own regex: no digits)
    out = subprocess.run([tokenize, "-m", path, "-p", text, "--ids", "--log-disable"],
                         capture_output=True, text=True, check=True, timeout=120,
                         env=dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(tokenize)))
    assert load_tokenizer(path).encode(text) == json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first_has_tensors", [True, False])
def test_a_model_llama_gguf_split_splits_loads_as_the_whole_file(quantized, tmp_path, first_has_tensors):
    """llama.cpp's `llama-gguf-split` on its own q4_k_m file (a first file of metadata alone with
    --no-tensor-first-split, as large models are published): the same tokens as the whole file."""
    try:
        split = tool("llama-gguf-split")
    except SkippedRun as e:
        pytest.skip(f"llama.cpp's llama-gguf-split is absent: {e}")
    path, _ = quantized["narrow", "q4_k_m"]
    options = [] if first_has_tensors else ["--no-tensor-first-split"]
    subprocess.run([split, "--split", "--split-max-tensors", "12", *options, path, str(tmp_path / "narrow")],
                   check=True, capture_output=True, timeout=600)
    parts = sorted(os.listdir(tmp_path))
    assert len(parts) > 2 and parts[0].startswith("narrow-00001-of-"), parts
    got = []
    for model in (path, str(tmp_path / parts[-1])):
        llm = LLM(model, num_kv_blocks=64)
        try:
            got.append(run(llm))
        finally:
            llm.shutdown()
    assert got[0] == got[1]
