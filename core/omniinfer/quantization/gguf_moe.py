"""Mixture-of-experts GGUF files: qwen2moe (Qwen1.5-MoE, Qwen2-57B-A14B), qwen3moe (Qwen3-30B-A3B,
Qwen3-235B-A22B), and Mixtral, which llama.cpp writes as a `llama` file with experts.

llama.cpp's converter stacks each layer's experts into one tensor per projection,
`blk.N.ffn_{gate,up,down}_exps.weight` ([experts, rows, cols], one type for all), keeps the router
`ffn_gate_inp` in float, and writes Qwen2-MoE's shared expert as `ffn_*_shexp` with its sigmoid
gate `ffn_gate_inp_shexp` (a vector). Here the stacks are read back one expert at a time under
the names of the Hugging Face checkpoint the model loads (`mlp.experts.E.gate_proj.weight`,
Mixtral's `block_sparse_moe.experts.E.w1.weight`), so each expert's bytes go to that expert's
slot as they are (omniinfer.quantization.experts). What the metadata does not say follows
llama.cpp's graphs: Qwen3-MoE renormalises the top-k routing weights, Qwen2-MoE does not,
Mixtral does; a layer without a router is a dense MLP (Qwen-MoE's `mlp_only_layers`).
"""

from __future__ import annotations

import re

from omniinfer.quantization.gguf_header import GGUFError

# llama.cpp's tensor -> the Hugging Face module under the layer, per family
_QWEN = {"ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
         "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
         "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
LAYER_NAMES = {"qwen2moe": _QWEN, "qwen3moe": _QWEN, "llama": {"ffn_gate_inp": "block_sparse_moe.gate"}}
# each family's experts: the module holding them, and the names of gate, up and down
EXPERTS = {"qwen2moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "qwen3moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "llama": ("block_sparse_moe", ("w1", "w3", "w2"))}
STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# Mixtral files of the first converters: one tensor per expert, `blk.N.ffn_gate.E.weight`
_SPLIT = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")


def expert_name(arch: str, layer: int | str, expert: int | str, stack: int) -> str:
    """The Hugging Face name of expert `expert`'s gate (0), up (1) or down (2) weight."""
    module, names = EXPERTS[arch]
    return f"model.layers.{layer}.{module}.experts.{expert}.{names[stack]}.weight"


def split_expert_name(name: str, arch: str) -> str | None:
    """A first-converter Mixtral file's per-expert tensor under its Hugging Face name (else None)."""
    m = _SPLIT.match(name)
    if m is None or arch != "llama":
        return None
    return expert_name(arch, m.group(1), m.group(3), ("ffn_gate", "ffn_up", "ffn_down").index(m.group(2)))


def moe_config(file, cfg: dict) -> None:
    """The file's experts into `cfg` (a Hugging Face config of the family); nothing for a file
    without `{arch}.expert_count` (a dense llama file)."""
    a = file.arch
    if a not in EXPERTS or (a == "llama" and not file.field("llama.expert_count")):
        return
    experts = file.count(f"{a}.expert_count")
    used = file.count(f"{a}.expert_used_count")
    if used > experts:
        raise GGUFError(f"{file.path}: metadata key {a + '.expert_used_count'!r} is {used}, more than "
                        f"{a}.expert_count={experts}")
    cfg["num_experts_per_tok"] = used
    if a == "llama":
        cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts)
        return
    cfg["num_experts"] = experts
    cfg["moe_intermediate_size"] = file.count(f"{a}.expert_feed_forward_length")
    cfg.setdefault("intermediate_size", cfg["moe_intermediate_size"])  # (only a dense layer's)
    cfg["norm_topk_prob"] = a == "qwen3moe"  # (llama.cpp's graphs: qwen3moe renormalises, qwen2moe not)
    layers = cfg["num_hidden_layers"]
    cfg["decoder_sparse_step"] = 1
    cfg["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in file.tensors]
    if a == "qwen2moe":
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in file.tensors
        shared = file.tensors.get("blk.0.ffn_gate_shexp.weight")
        cfg["shared_expert_intermediate_size"] = 0 if shared is None else shared[2][0]
        if shared is not None and file.field(f"{a}.expert_shared_feed_forward_length") is not None:
            cfg["shared_expert_intermediate_size"] = file.count(f"{a}.expert_shared_feed_forward_length")


def is_stack(name: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in STACKS


def expert_views(arch: str, name: str, shape: tuple[int, ...], n_bytes: int) -> list[tuple[str, int, tuple]]:
    """A stack `blk.N.ffn_*_exps.weight` of `shape` [experts, rows, cols] as (Hugging Face name,
    byte offset within the tensor, the expert's [rows, cols]) for each expert."""
    if arch not in EXPERTS or len(shape) != 3:
        raise GGUFError(f"tensor {name!r} of shape {shape}: experts are read as [experts, rows, cols] "
                        f"stacks of the {'/'.join(EXPERTS)} families")
    layer, stack = name.split(".")[1], STACKS.index(name.split(".")[2])
    per = n_bytes // shape[0]
    return [(expert_name(arch, layer, e, stack), e * per, shape[1:]) for e in range(shape[0])]
