"""A Hugging Face Llama, Qwen2, Qwen3, Phi-3, Gemma 2/3, Mixtral, Qwen2-MoE or Qwen3-MoE checkpoint
written as a GGUF file, with the `gguf` package, so llama.cpp reads the very weights omniinfer
runs (`--compare llama.cpp` in the benchmarks).

Names, shapes and metadata follow llama.cpp's own converter (convert_hf_to_gguf.py): tensors as
``blk.N.attn_q.weight`` and so on, Llama's q/k rows permuted from Hugging Face's rotate-half
order to GGML's interleaved rotary (the others use the NeoX order and keep them), norms and
biases and routers in float32, each layer's experts stacked into one [experts, rows, cols] tensor
per projection, the other weights in the types llama.cpp's quantiser gives them for the file
type asked for (`tensor_type`: its mixes and its fallbacks; the K-quants through
omniinfer.testing.kquant's round-to-nearest quantisers, as the gguf package has none). The
vocabulary is the checkpoint's tokenizer, padded with unused tokens up to the model's vocabulary
size (random checkpoints have a small tokenizer and a large embedding); a llama3 rope scaling as
its 'rope_freqs.weight' factors, Phi-3's longrope as its 'rope_factors_long/short.weight'.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from omniinfer.hf_config import rope_scaling, rope_theta
from omniinfer.quantization.gguf_file import _ARCH_LAYER
from omniinfer.quantization.gguf_file import _LAYER as _GGUF_LAYER
from omniinfer.quantization.gguf_file import ARCHITECTURES as _GGUF_ARCHS
from omniinfer.quantization.gguf_moe import EXPERTS, LAYER_NAMES, STACKS
from omniinfer.testing import kquant

FILE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k",
              "q4_k_m", "q5_k_m", "q2_k", "q3_k_m", "iq4_nl", "iq4_xs")
# llama.cpp's lattice types: their one type throughout, not llama.cpp's mixes, and only with a
# quantiser registered for the type in kquant.QUANTIZERS (nothing here quantises to them; tests
# register a stand-in, kquant.lattice_noise)
LATTICE_FILE_TYPES = ("iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq1_s", "iq1_m")
# the GGUF file type code each writes (llama_ftype), for general.file_type
_FTYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9,
          "q4_k": 14, "q5_k": 16, "q6_k": 18, "q4_k_m": 15, "q5_k_m": 17, "q2_k": 10, "q3_k_m": 12,
          "iq4_nl": 25, "iq4_xs": 30, "iq2_xxs": 19, "iq2_xs": 20, "iq2_s": 28, "iq3_xxs": 23, "iq3_s": 26,
          "iq1_s": 24, "iq1_m": 31}
_FLOAT = ("f32", "f16", "bf16")
_BASE = {"q4_k_m": "Q4_K", "q5_k_m": "Q5_K", "q3_k_m": "Q3_K"}  # (else the file type's own)
# llama.cpp's quantiser, where a row is not whole blocks of the type it chose: a 256-block type
# falls back to a 32-block one, then (as everything) to F16
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
             "IQ4_XS": "IQ4_NL"}


def _block(kind: str) -> int:
    from omniinfer.quantization.gguf_blocks import BY_NAME

    return BY_NAME[kind].block


def more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down get Q6_K in a *_K_M file (the
    first and last eighth, and every third between)."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def _mixed(role: str, file_type: str, layer: int, num_layers: int, gqa: int, experts: int = 0) -> str | None:
    """The type a *_K_M, q2_k or iq4 file gives attn_v / ffn_down / attn_output of `layer` (llama.cpp,
    a model that is not Falcon; `experts`: its expert count, whose rules for 8 experts, Mixtral's,
    come first), or None: the file's own."""
    role = role.removesuffix("_exps").removesuffix("_shexp")  # (llama.cpp: by what the name contains)
    if experts == 8 and role in ("attn_v", "attn_k"):
        return "Q8_0"  # ("for the 8-expert model, bumping this to Q8_0 trades just ~128MB")
    if experts == 8 and role == "attn_output":
        return "Q5_K" if file_type in ("q2_k", "q3_k_m", "iq4_nl", "q4_k_m", "iq4_xs") else None
    if role == "attn_qkv":  # (a fused q/k/v: Phi-3's)
        return {"q3_k_m": "Q4_K", "q4_k_m": "Q5_K", "q5_k_m": "Q6_K"}.get(file_type)
    if file_type in ("q4_k_m", "q5_k_m"):
        return "Q6_K" if role in ("attn_v", "ffn_down") and more_bits(layer, num_layers) else None
    if file_type == "q3_k_m":
        return {"attn_v": "Q5_K" if layer < 2 else "Q4_K", "attn_output": "Q4_K",
                "ffn_down": "Q5_K" if layer < num_layers // 16 else "Q4_K"}.get(role)
    if file_type == "q2_k":
        return {"attn_v": "Q4_K" if gqa >= 4 else "Q3_K", "attn_output": "Q3_K", "ffn_down": "Q3_K"}.get(role)
    if file_type in ("iq4_nl", "iq4_xs"):
        return {"attn_v": "Q5_K" if gqa >= 4 else None,
                "ffn_down": "Q5_K" if layer < num_layers // 8 else None}.get(role)
    return None


def tensor_type(gguf_tensor: str, file_type: str, cols: int, num_layers: int = 1, tied: bool = False,
                gqa: int = 1, experts: int = 0) -> str:
    """The type llama.cpp's quantiser (llama-quant.cpp, llama_tensor_get_type) gives a 2-D tensor
    of a `file_type` file, for the types here (`gqa`: query heads per KV head):

    * the output (or, with tied embeddings, token_embd, which then is the output): Q6_K in every
      quantised file type but q8_0, Q8_0 where the row is not whole blocks of the file's type;
    * q4_k_m / q5_k_m: Q4_K / Q5_K, but attn_v and ffn_down in Q6_K in the layers `more_bits`
      picks; q3_k_m: Q3_K, attn_v Q5_K in the first two layers and Q4_K after, attn_output Q4_K,
      ffn_down Q5_K in the first sixteenth and Q4_K after; q2_k: Q2_K, attn_v Q3_K (Q4_K at 4+
      query heads a KV head), attn_output and ffn_down Q3_K; iq4_nl / iq4_xs: their type, attn_v
      Q5_K at 4+ query heads a KV head, ffn_down Q5_K in the first eighth;
    * experts (`ffn_*_exps`) and shared experts (`ffn_*_shexp`) as their dense roles; with 8
      experts (Mixtral), attn_v and attn_k in Q8_0 (every file type) and attn_output Q5_K in the
      K-quant and IQ4 mixes;
    * the rest in the file's type;
    * a row that is not whole blocks of that type falls back: Q2_K and Q3_K to Q4_0, Q4_K to Q5_0,
      Q5_K to Q5_1, Q6_K to Q8_0, IQ4_XS to IQ4_NL (Qwen2.5-0.5B's 896 columns: its q4_k_m file is
      mostly Q5_0), then to F16.
    """
    if ".ffn_gate_inp" in gguf_tensor:  # (a router: the converter writes it in float32, the quantiser keeps it)
        return "F32"
    if file_type in _FLOAT:
        return file_type.upper()
    base = _BASE.get(file_type, file_type.upper())
    kind = base
    if gguf_tensor == "output.weight" or (tied and gguf_tensor == "token_embd.weight"):
        kind = "Q8_0" if cols % _block(base) or base == "Q8_0" else "Q6_K"
    elif gguf_tensor.startswith("blk."):
        _, layer, role, _ = gguf_tensor.split(".")
        kind = _mixed(role, file_type, int(layer), num_layers, gqa, experts) or base
    if cols % _block(kind):
        kind = _FALLBACK.get(kind, "F16")
        if cols % _block(kind):
            kind = "F16"
    return kind


_ARCHS = {**{hf: arch for arch, hf in _GGUF_ARCHS.items()}, "MistralForCausalLM": "llama",
          "MixtralForCausalLM": "llama"}
# each family's router and shared expert (llama.cpp's names; the experts themselves are stacked)
_MOE_NAMES = {hf: name for layer in LAYER_NAMES.values() for name, hf in layer.items()}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    layer = {hf: name for name, hf in {**_GGUF_LAYER, **_ARCH_LAYER.get(arch, {})}.items()}  # (the reader's, inverted)
    if parts[:2] == ["model", "layers"]:
        inner, kind = ".".join(parts[3:-1]), parts[-1]
        if inner in layer:
            return f"blk.{parts[2]}.{layer[inner]}.{kind}"
        if inner in _MOE_NAMES:
            return f"blk.{parts[2]}.{_MOE_NAMES[inner]}.{kind}"
    raise ValueError(f"tensor {hf_name!r} has no GGUF name here (Llama, Qwen2, Qwen3, Phi-3 and Gemma 2/3 "
                     "layouts only)")


def _permute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's rotate-half rows of q/k into GGML's interleaved order (llama.cpp's)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export(model_dir: str, out_path: str, file_type: str = "f32", split_max_tensors: int = 0) -> str:
    """Write `model_dir` (config.json, safetensors, tokenizer) to `out_path` as GGUF; returns the
    path. `split_max_tensors`: split it as gguf-split does, at most that many tensors a file, in
    files the `gguf` package names (`out_path` x.gguf -> x-00001-of-0000N.gguf ...); returns the
    first's path."""
    import gguf
    from safetensors.torch import load_file  # (numpy has no bfloat16)

    if file_type not in FILE_TYPES + LATTICE_FILE_TYPES:
        raise ValueError(f"file_type={file_type!r}: expected one of {', '.join(FILE_TYPES)}")
    if file_type in LATTICE_FILE_TYPES and file_type.upper() not in kquant.QUANTIZERS:
        raise ValueError(f"file_type={file_type!r}: nothing here quantises to {file_type.upper()} (llama.cpp's "
                         "llama-quantize does); register a quantiser in kquant.QUANTIZERS first")
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    (architecture,) = cfg["architectures"]
    if architecture not in _ARCHS:
        raise ValueError(f"architecture {architecture!r}: this exporter writes {', '.join(_ARCHS)}")
    arch = _ARCHS[architecture]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    writer = gguf.GGUFWriter(out_path, arch, split_max_tensors=split_max_tensors)
    writer.add_name(os.path.basename(os.path.normpath(model_dir)))
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    if cfg.get("head_dim"):  # (as llama.cpp's converter)
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    theta, scaling = _global_rope(cfg)
    writer.add_rope_freq_base(theta)
    if scaling and scaling["rope_type"] == "linear":  # (Gemma 3's global layers)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    writer.add_file_type(_FTYPE[file_type])
    experts = _moe_metadata(writer, cfg, arch)
    _add_vocab(writer, model_dir, cfg["vocab_size"], arch)
    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    factors = _llama3_factors(cfg, heads)
    if factors is not None:
        writer.add_tensor("rope_freqs.weight", factors)
    if arch == "phi3":
        for name, value in _phi3_metadata(writer, cfg, heads).items():
            writer.add_tensor(name, value)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(int(cfg["sliding_window"]))
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):  # (Gemma 3 has no attention cap)
            if cfg.get(key) is not None:
                getattr(writer, f"add_{key}")(float(cfg[key]))
    tied = bool(cfg.get("tie_word_embeddings"))
    if tied:
        tensors.pop("lm_head.weight", None)
    stacks: dict[str, dict[int, np.ndarray]] = {}  # an expert stack's name -> its experts
    for hf_name, value in tensors.items():
        w = value.float().numpy()
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            w = w + 1.0  # (as llama.cpp's converter: ggml's RMSNorm multiplies by the weight, Gemma's by 1 + it)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute_rotary(w, heads if "q_proj" in hf_name else kv_heads)
        expert = _EXPERT.match(hf_name)
        if expert is not None and experts:
            layer, e, which = expert.groups()
            stack = f"blk.{layer}.{STACKS[EXPERTS[arch][1].index(which)]}.weight"
            stacks.setdefault(stack, {})[int(e)] = w
            continue
        name = gguf_name(hf_name, arch)
        if name.endswith("ffn_gate_inp_shexp.weight"):
            w = w.reshape(-1)  # (a [1, hidden] layer, written as the vector llama.cpp reads)
        _add_tensor(writer, name, w, file_type, cfg, tied, experts)
    for name, parts in stacks.items():  # (as llama.cpp's converter: each projection's experts in one tensor)
        _add_tensor(writer, name, np.stack([parts[e] for e in range(experts)]), file_type, cfg, tied, experts)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(writer.format_shard_names(Path(out_path))[0])


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")


def _add_tensor(writer, name: str, w: np.ndarray, file_type: str, cfg: dict, tied: bool, experts: int) -> None:
    """One tensor (or a stack of experts, [experts, rows, cols]) in the type the file type gives it."""
    import gguf

    heads = cfg["num_attention_heads"]
    gqa = heads // cfg.get("num_key_value_heads", heads)
    kind = "F32" if w.ndim == 1 else tensor_type(name, file_type, w.shape[-1], cfg["num_hidden_layers"], tied,
                                                 gqa, experts)
    if kind == "F32":
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))  # norms, biases, routers
        return
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    rows = np.ascontiguousarray(w.reshape(-1, w.shape[-1]))
    data = kquant.QUANTIZERS[kind](rows) if kind in kquant.QUANTIZERS else gguf.quants.quantize(rows, qtype)
    data = data.reshape(*w.shape[:-1], -1)
    writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)


def _moe_metadata(writer, cfg: dict, arch: str) -> int:
    """A mixture of experts' keys as llama.cpp's converter writes them; returns the expert count
    (0: a dense model)."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not experts:
        return 0
    writer.add_expert_count(experts)
    writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
    if arch != "llama":  # (Mixtral's experts are intermediate_size wide)
        writer.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
    return experts


def _global_rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope base, scaling) of the full-attention layers (Gemma 3's per layer type; else the model's)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        full = dict(params["full_attention"])
        kind = full.get("rope_type", "default")
        return float(full.get("rope_theta", 1_000_000.0)), None if kind == "default" else {**full, "rope_type": kind}
    return float(rope_theta(cfg)), rope_scaling(cfg)


def _llama3_factors(cfg: dict, heads: int) -> np.ndarray | None:
    """A llama3 rope scaling as llama.cpp's converter writes it: the factor each rotary frequency
    is divided by ('rope_freqs.weight', float32 [head_dim / 2]); None without one."""
    s = rope_scaling(cfg)
    if not s or s["rope_type"] != "llama3":
        return None
    dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    freqs = 1.0 / (rope_theta(cfg) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = s.get("factor", 8.0), s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, medium)).astype(np.float32)


def _phi3_metadata(writer, cfg: dict, heads: int) -> dict[str, np.ndarray]:
    """Phi-3's keys as llama.cpp's converter writes them; its longrope factors as the tensors it
    writes them as (returned)."""
    s = rope_scaling(cfg) or {}
    max_len = cfg.get("max_position_embeddings", 2048)
    original = s.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or max_len
    writer.add_rope_scaling_orig_ctx_len(int(original))
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(int(partial * cfg["hidden_size"]) // heads)  # (llama.cpp's converter's)
    writer.add_sliding_window(int(cfg.get("sliding_window") or 0))
    if not s.get("long_factor"):
        return {}
    scale = max_len / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    return {f"rope_factors_{k}.weight": np.asarray(s[f"{k}_factor"], dtype=np.float32) for k in ("long", "short")}


def _add_vocab(writer, model_dir: str, vocab_size: int, arch: str) -> None:
    """The tokenizer, padded to vocab_size: a byte-level BPE one as llama.cpp's "gpt2" model; a
    SentencePiece-style one (BPE with byte fallback: Llama 2's, Mistral's, Gemma's) as its "llama"
    model, as llama.cpp's converter writes a Hugging Face checkpoint of those: `<0xNN>` tokens of
    type BYTE, <unk> UNKNOWN, the special tokens CONTROL, a score per token (here the negated id:
    BPE training numbers pieces in merge order, which llama.cpp's SentencePiece tokenizer merges
    by) and the merges."""
    with open(os.path.join(model_dir, "tokenizer.json"), encoding="utf-8") as f:
        tok = json.load(f)
    vocab = tok["model"]["vocab"]
    sentencepiece = bool(tok["model"].get("byte_fallback"))
    tokens = [""] * max(vocab_size, len(vocab))
    types = [5] * len(tokens)  # UNUSED until filled
    for text, i in vocab.items():
        byte = sentencepiece and len(text) == 6 and text.startswith("<0x") and text.endswith(">")
        tokens[i], types[i] = text, 6 if byte else 1  # BYTE, NORMAL
    for added in tok.get("added_tokens", []):
        unknown = added["content"] == tok["model"].get("unk_token")
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 2 if unknown else 3 if added.get("special") else 4
    for i, text in enumerate(tokens):
        if not text:
            tokens[i] = f"[PAD{i}]"
    merges = tok["model"].get("merges", [])
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    if sentencepiece:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        unk = tok["model"].get("unk_token")
        if unk in vocab:
            writer.add_unk_token_id(vocab[unk])
        if arch.startswith("gemma"):  # (llama.cpp's converter: Gemma puts no space before the text)
            writer.add_add_space_prefix(False)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2" if arch in ("qwen2", "qwen3", "qwen2moe", "qwen3moe") else "default")
        writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("bos_token_id") is not None:
        writer.add_bos_token_id(cfg["bos_token_id"])
    if cfg.get("eos_token_id") is not None:
        writer.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:
        writer.add_pad_token_id(cfg["pad_token_id"])
    tokenizer_config = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(tokenizer_config):  # (as llama.cpp's converter: the chat template, BOS / EOS flags)
        with open(tokenizer_config, encoding="utf-8") as f:
            settings = json.load(f)
        templates = _chat_templates(model_dir, settings)
        if templates:
            writer.add_chat_template(templates)
        if isinstance(settings.get("add_bos_token"), bool):
            writer.add_add_bos_token(settings["add_bos_token"])
        if isinstance(settings.get("add_eos_token"), bool):
            writer.add_add_eos_token(settings["add_eos_token"])


def _chat_templates(model_dir: str, settings: dict) -> str | list[dict] | None:
    """The checkpoint's chat template(s) as gguf's writer takes them (a string, or named ones as
    [{"name", "template"}]): tokenizer_config.json's `chat_template` (transformers 4), else
    chat_template.jinja and additional_chat_templates/*.jinja (transformers 5)."""
    value = settings.get("chat_template")
    if isinstance(value, (str, list)):
        return value
    templates = []
    default = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(default):
        with open(default, encoding="utf-8") as f:
            templates.append({"name": "default", "template": f.read()})
    extra = os.path.join(model_dir, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra, name), encoding="utf-8") as f:
                    templates.append({"name": name[: -len(".jinja")], "template": f.read()})
    if len(templates) == 1 and templates[0]["name"] == "default":
        return templates[0]["template"]
    return templates or None
