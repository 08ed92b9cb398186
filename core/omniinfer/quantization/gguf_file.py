"""GGUF files (llama.cpp's format): the model's config from the file's metadata, its tensors
under Hugging Face names (quantised ones as QuantPieces, read lazily and only as far as a rank
needs), and the tokenizer transformers builds from the file. The header is read by
gguf_header.py (held to the `gguf` package's reader in the tests); the blocks are dequantised as
the `gguf` package does (gguf_blocks.py).

Families: llama (Llama 1-3, Mistral; Mixtral: a llama file with experts), qwen2, qwen3, phi3
(Phi-3, Phi-3.5: fused q/k/v and gate/up tensors, as Hugging Face's), gemma2 and gemma3 (text;
their norm weights stored as 1 + w, as llama.cpp's converter writes them), qwen2moe and qwen3moe
(the mixtures of experts: gguf_moe.py). A model split across files (gguf-split) is read as
one (gguf_header.open_shards). The file is checked before anything large is allocated: every
tensor's bytes must lie inside its file and match its type and shape.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch

from omniinfer.models.layers.rotary import rotary_dim
from omniinfer.models.layers.weights import WeightShapeError
from omniinfer.quantization import gguf_blocks, gguf_moe
from omniinfer.quantization.base import QuantPiece, register_format
from omniinfer.quantization.gguf_header import GGUFError, open_shards

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "is_gguf"]

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}  # (+ Mixtral: llama)
_MODEL_TYPES = {"gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}  # (else the name)
_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # (qwen3)
    "attn_qkv": "self_attn.qkv_proj",  # (phi3)
}
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}  # (a norm before and after each block)
_ARCH_LAYER = {"phi3": {"ffn_up": "mlp.gate_up_proj"},  # (gate and up in one tensor)
               "gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS, **gguf_moe.LAYER_NAMES}
# llama.cpp's rules for what a Gemma file does not say: a sliding layer to each global one (2) or
# five to one (6), the sliding layers' rope base (Gemma 3), and the 27B models' attention scale
# (by their layer count: 1 / sqrt(hidden / heads), where the others' is 1 / sqrt(head_dim))
_GEMMA = {"gemma2": dict(pattern=2, layers_27b=46), "gemma3": dict(pattern=6, layers_27b=62, local_theta=10000.0)}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# rotary factors, read into the config (hf_config), not weights
_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_PARTIAL_ROTARY = ("phi3", "gemma2", "gemma3")  # (llama.cpp's other graphs here assert n_rot == the head size)


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    for v in values:
        if out and int(out[-1].rsplit("-", 1)[-1]) == v - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def is_gguf(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(".gguf") and os.path.isfile(path)


def hf_name(name: str, arch: str = "llama") -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    parts = name.split(".")
    layer = {**_LAYER, **_ARCH_LAYER.get(arch, {})}
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer:
        return f"model.layers.{parts[1]}.{layer[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP:
        return f"{_TOP[parts[0]]}.{parts[1]}"
    split = gguf_moe.split_expert_name(name, arch)
    if split is not None:
        return split
    raise GGUFError(f"tensor {name!r} is not one omniinfer knows in a {'/'.join(ARCHITECTURES)} GGUF file")


class GGUFFile:
    """An open GGUF file (memory-mapped): metadata, tensors, checked."""

    def __init__(self, path: str):
        # a split model's files (gguf-split): the metadata is the first's, the tensors all of theirs
        self.shards = open_shards(os.fspath(path))
        self.header = self.shards[0]
        self.path = self.header.path
        # name -> (offset, kind, shape (slowest first), bytes, shard)
        self.tensors: dict[str, tuple[int, gguf_blocks.BlockType, tuple[int, ...], int, int]] = {}
        for index, shard in enumerate(self.shards):
            for t in shard.tensors:
                if t.name in self.tensors:
                    raise GGUFError(f"{shard.path}: tensor {t.name!r} is in "
                                    f"{self.shards[self.tensors[t.name][4]].path} too")
                try:
                    kind = gguf_blocks.type_of(t.type_code, t.name)
                except ValueError as e:
                    raise GGUFError(f"{shard.path}: {e}") from None
                shape = tuple(reversed(t.dims))  # GGUF lists the fastest dim first
                cols = shape[-1]
                rows = math.prod(shape[:-1])  # (Python's integers: numpy's would wrap a corrupt shape)
                if cols % kind.block:
                    raise GGUFError(f"{shard.path}: tensor {t.name!r} ({kind.name}) has {cols} columns, not a "
                                    f"multiple of its block of {kind.block}")
                expected = rows * kind.row_bytes(cols)
                if t.offset + expected > shard.size:
                    raise GGUFError(f"{shard.path}: tensor {t.name!r} ({kind.name}, shape {shape}) needs "
                                    f"{expected} bytes at offset {t.offset}, but the file has "
                                    f"{shard.size} bytes: truncated or corrupt")
                self.tensors[t.name] = (t.offset, kind, shape, expected, index)
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise GGUFError(f"{self.path}: architecture {self.arch!r} is not supported; supported: "
                            f"{', '.join(ARCHITECTURES)}")

    def field(self, key: str, default=None):
        return self.header.get(key, default)

    def tensor_bytes(self) -> dict[str, int]:
        """name -> the bytes the tensor takes in the file."""
        return {name: entry[3] for name, entry in self.tensors.items()}

    def hf_config(self) -> dict:
        """The config.json a Hugging Face checkpoint of this model would have."""
        a = self.arch
        need = {"hidden_size": f"{a}.embedding_length", "num_hidden_layers": f"{a}.block_count",
                "intermediate_size": f"{a}.feed_forward_length", "num_attention_heads": f"{a}.attention.head_count"}
        if a in ("qwen2moe", "qwen3moe") and self.field(need["intermediate_size"]) is None:
            del need["intermediate_size"]  # (all layers sparse: gguf_moe.moe_config)
        cfg = {"architectures": [ARCHITECTURES[a]], "model_type": _MODEL_TYPES.get(a, a)}
        cfg.update({name: self.count(key) for name, key in need.items()})
        blocks = {int(n.split(".")[1]) for n in self.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
        if blocks != set(range(cfg["num_hidden_layers"])):  # (before a model of that many layers is built)
            raise GGUFError(f"{self.path}: metadata key {need['num_hidden_layers']!r} is "
                            f"{cfg['num_hidden_layers']}, but the file's tensors are of blocks "
                            f"{_ranges(sorted(blocks)) or 'none'}")
        cfg["num_key_value_heads"] = self.count(f"{a}.attention.head_count_kv", cfg["num_attention_heads"])
        if self.field(f"{a}.attention.key_length") is not None:  # (else hidden / heads)
            cfg["head_dim"] = self.count(f"{a}.attention.key_length")
        cfg["rms_norm_eps"] = float(self.field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6))
        cfg["rope_theta"] = float(self.field(f"{a}.rope.freq_base", 10000.0))
        cfg["max_position_embeddings"] = int(self.field(f"{a}.context_length", 2048))
        self._rotary_dims(cfg)
        scaling = self.field(f"{a}.rope.scaling.type")
        linear = None
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise GGUFError(f"{self.path}: rope scaling {scaling!r} is not supported for GGUF files yet "
                                "(linear is, and the frequency factors of a 'rope_freqs.weight' tensor)")
            linear = float(self.field(f"{a}.rope.scaling.factor", 1.0))
        if "rope_freqs.weight" in self.tensors:  # (llama.cpp's converter writes Llama 3.1's llama3 scaling so)
            factors = self.rope_factors("rope_freqs.weight", cfg) * (linear or 1.0)  # (llama.cpp: over both)
            cfg["rope_scaling"] = {"rope_type": "freq_factors", "factors": factors.tolist()}
        elif linear is not None:
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": linear}
        if a == "phi3":
            self._phi3(cfg)
        if a in _GEMMA:
            self._gemma(cfg)
        gguf_moe.moe_config(self, cfg)
        embd = self.tensors.get("token_embd.weight")
        if embd is None:
            raise GGUFError(f"{self.path}: tensor 'token_embd.weight' is missing")
        cfg["vocab_size"] = embd[2][0]
        cfg["tie_word_embeddings"] = "output.weight" not in self.tensors
        for ours, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                          ("eos_token_id", "tokenizer.ggml.eos_token_id")):
            value = self.field(key)
            if value is not None:
                cfg[ours] = int(value)
        cfg["attention_bias"] = False  # (qwen2's q/k/v biases are its model_type's)
        return cfg

    def count(self, key: str, default: int | None = None) -> int:
        """A metadata count the config is built from: present (or defaulted) and positive."""
        value = self.field(key, default)
        if value is None:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        if not isinstance(value, (int, np.integer)) or not 0 < int(value) < 1 << 24:
            raise GGUFError(f"{self.path}: metadata key {key!r} is {value!r}; expected a positive count")
        return int(value)

    def _rotary_dims(self, cfg: dict) -> None:
        """`rope.dimension_count`, llama.cpp's n_rot: the features of each head that turn. Fewer
        than the head (Phi-4-mini's 96 of 128) is Hugging Face's partial_rotary_factor, in the
        architectures whose llama.cpp graphs take it (_PARTIAL_ROTARY); the others' graphs assert
        whole heads, and so does this."""
        a = self.arch
        head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        dims = self.field(f"{a}.rope.dimension_count")
        if dims is None or dims == head:
            return
        if not isinstance(dims, (int, np.integer)) or not 0 < int(dims) <= head or dims % 2:
            raise GGUFError(f"{self.path}: {a}.rope.dimension_count={dims!r}: expected an even count of "
                            f"the {head} features of a head, at least 2")
        if a not in _PARTIAL_ROTARY:
            raise GGUFError(f"{self.path}: {a}.rope.dimension_count={dims} turns part of each {head}-wide "
                            f"head; a {a} file turns whole heads (llama.cpp's too; part of them: "
                            f"{', '.join(_PARTIAL_ROTARY)})")
        cfg["partial_rotary_factor"] = int(dims) / head  # (rotary_dim() turns it back into dims)

    def _phi3(self, cfg: dict) -> None:
        """Phi-3's metadata beyond Llama's: its sliding window (0: none), original context and
        the longrope factors of its 128k models (tensors, as llama.cpp's converter writes them,
        one for each rotary frequency)."""
        window = int(self.field("phi3.attention.sliding_window", 0) or 0)
        cfg["sliding_window"] = window or None
        original = self.field("phi3.rope.scaling.original_context_length")
        if original is not None:
            cfg["original_max_position_embeddings"] = int(original)
        if "rope_factors_long.weight" in self.tensors or "rope_factors_short.weight" in self.tensors:
            if original is None:
                raise GGUFError(f"{self.path}: longrope factors without phi3.rope.scaling.original_context_length")
            cfg["rope_scaling"] = {"rope_type": "longrope", "original_max_position_embeddings": int(original),
                                   **{f"{k}_factor": self.rope_factors(f"rope_factors_{k}.weight", cfg).tolist()
                                      for k in ("long", "short")}}
            attention = self.field("phi3.rope.scaling.attn_factor")
            if attention is not None:
                cfg["rope_scaling"]["attention_factor"] = float(attention)

    def _gemma(self, cfg: dict) -> None:
        """Gemma 2 / 3's metadata beyond Llama's, and llama.cpp's rules (_GEMMA) for the rest."""
        a, rules = self.arch, _GEMMA[self.arch]
        if "head_dim" not in cfg:
            raise GGUFError(f"{self.path}: metadata key {a + '.attention.key_length'!r} is missing")
        layers = cfg["num_hidden_layers"]
        cfg["layer_types"] = ["full_attention" if (i + 1) % rules["pattern"] == 0 else "sliding_attention"
                              for i in range(layers)]
        cfg["sliding_window"] = int(self.field(f"{a}.attention.sliding_window", 4096))
        big = layers == rules["layers_27b"]
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"]
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = self.field(f"{a}.{key}")
            cfg[key] = None if value is None else float(value)
        if "local_theta" in rules:
            cfg["rope_local_base_freq"] = rules["local_theta"]

    def rope_factors(self, name: str, cfg: dict) -> np.ndarray:
        """A rotary factor tensor (float64 [head_dim / 2]): 'rope_freqs.weight', what each frequency
        is divided by (llama.cpp's rope: theta_i = position * base ** (-2i / head_dim) / factor_i),
        or Phi-3's 'rope_factors_long.weight' / 'rope_factors_short.weight' (longrope's)."""
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing")
        offset, kind, shape, n_bytes, shard = self.tensors[name]
        pairs = rotary_dim(cfg, cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]) // 2
        if kind.name != "F32" or shape != (pairs,):
            raise GGUFError(f"{self.path}: tensor {name!r} is {kind.name} of shape {shape}; expected F32 "
                            f"of shape ({pairs},), a factor for each rotary frequency")
        factors = self.shards[shard].map[offset:offset + n_bytes].view("<f4").astype(np.float64)
        if not np.all(np.isfinite(factors) & (factors > 0)):
            raise GGUFError(f"{self.path}: tensor {name!r} holds {factors.tolist()}; its factors "
                            "must be finite and positive")
        return factors

    def named_tensors(self):
        """(Hugging Face name, GGUFTensor) for every weight, in the file's order (the rotary
        factor tensors go into the config: hf_config)."""
        heads = self.hf_config()
        for name, (offset, kind, shape, n_bytes, shard) in self.tensors.items():
            if name in _ROPE_TENSORS:
                continue
            perm_heads = None
            if self.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
                perm_heads = heads["num_attention_heads"] if "attn_q" in name else heads["num_key_value_heads"]
            path, data = self.shards[shard].path, self.shards[shard].map[offset:offset + n_bytes]
            if gguf_moe.is_stack(name):  # (one expert at a time: each to its own slot)
                for ours, at, part in gguf_moe.expert_views(self.arch, name, shape, n_bytes):
                    expert = f"{name}[{ours.split('.experts.')[1].split('.')[0]}]"
                    yield ours, GGUFTensor(path, expert, data[at:at + n_bytes // shape[0]], kind, part)
                continue
            if name.endswith("ffn_gate_inp_shexp.weight") and len(shape) == 1:
                shape = (1, shape[0])  # (Qwen2-MoE's shared expert gate: a vector; Hugging Face's a 1-row layer)
            # (Gemma's norms: llama.cpp's converter adds the 1 its RMSNorm adds, Hugging Face's does not)
            offset_added = 1.0 if self.arch in _GEMMA and name.endswith("norm.weight") else 0.0
            yield hf_name(name, self.arch), GGUFTensor(path, name, data, kind, shape, perm_heads, offset_added)


def _rope_order(rows: int, heads: int) -> torch.Tensor:
    """For llama files: the file's row of each Hugging Face row of q / k (llama.cpp's converter
    interleaves each head's two rotary halves; this model rotates halves)."""
    d = rows // heads
    h, half, i = torch.meshgrid(torch.arange(heads), torch.arange(2), torch.arange(d // 2), indexing="ij")
    return (h * d + 2 * i + half).reshape(-1)


class GGUFTensor:
    """One tensor of a GGUF file, read as far as a rank needs: `narrow` along rows or (block
    aligned) columns gives a QuantPiece of those bytes, or, for float types, a float tensor."""

    def __init__(self, path: str, name: str, data: np.ndarray, kind: gguf_blocks.BlockType,
                 shape: tuple[int, ...], perm_heads: int | None = None, offset_added: float = 0.0):
        """`offset_added`: what the file added to every value of a float vector (taken off as read)."""
        if offset_added and (len(shape) != 1 or kind.block > 1):
            raise GGUFError(f"{path}: tensor {name!r} ({kind.name}, shape {shape}): an offset is taken off float "
                            "vectors only")
        self.path, self.name, self.kind, self.shape = path, name, kind, shape
        self.offset_added = offset_added
        self._data = data  # numpy memmap: the tensor's bytes
        self._rows = None if perm_heads is None else _rope_order(shape[0], perm_heads)

    @property
    def is_quantized(self) -> bool:
        return self.kind.block > 1

    def _bytes(self, rows) -> torch.Tensor:
        raw = self._data.view(np.uint8).reshape(self.shape[0] if len(self.shape) > 1 else 1, -1)
        return torch.from_numpy(np.array(raw[rows], copy=True))  # (owned: the map closes after loading)

    def _row_index(self, start: int, length: int):
        if self._rows is None:
            return slice(start, start + length)
        return self._rows[start:start + length].numpy()

    def full(self):
        return self.narrow(0, 0, self.shape[0]) if len(self.shape) > 1 else self._float(self._bytes(slice(None)))

    def _float(self, raw: torch.Tensor) -> torch.Tensor:
        cols = self.shape[-1]
        out = gguf_blocks.dequantize(raw, self.kind, cols)
        if len(self.shape) > 1:
            return out
        return out.reshape(-1) - self.offset_added if self.offset_added else out.reshape(-1)

    def narrow(self, dim: int, start: int, length: int):
        if len(self.shape) == 1:
            return self.full().narrow(0, start, length)
        rows, cols = self.shape
        if dim == 0:
            raw = self._bytes(self._row_index(start, length))
            return QuantPiece(f"gguf:{self.kind.name}", (length, cols), {"blocks": raw}) if self.is_quantized \
                else self._float(raw)
        whole = self.narrow(0, 0, rows)
        if not self.is_quantized:
            return whole.narrow(1, start, length)
        return narrow_gguf(whole, 1, start, length, self.name)


def narrow_gguf(piece: QuantPiece, dim: int, start, length: int | None = None, name: str = "") -> QuantPiece:
    kind = gguf_blocks.BY_NAME[piece.kind.split(":", 1)[1]]
    blocks = piece.tensors["blocks"]
    rows, cols = piece.shape
    if dim == 0:
        if isinstance(start, torch.Tensor):
            return QuantPiece(piece.kind, (start.numel(), cols), {"blocks": blocks[start]})
        return QuantPiece(piece.kind, (length, cols), {"blocks": blocks.narrow(0, start, length)})
    if start % kind.block or length % kind.block:
        raise WeightShapeError(f"{name or 'a ' + kind.name + ' tensor'}: columns {start}..{start + length} do "
                               f"not fall on its {kind.name} blocks of {kind.block} (tensor parallelism "
                               f"splits the columns of a row-parallel layer); use fewer ranks")
    b0, nb = start // kind.block * kind.block_bytes, length // kind.block * kind.block_bytes
    return QuantPiece(piece.kind, (rows, length), {"blocks": blocks.narrow(1, b0, nb).contiguous()})


def _dequantize_gguf(piece: QuantPiece) -> torch.Tensor:
    kind = gguf_blocks.BY_NAME[piece.kind.split(":", 1)[1]]
    return gguf_blocks.dequantize(piece.tensors["blocks"], kind, piece.shape[1])


register_format("gguf", _dequantize_gguf, narrow_gguf)
