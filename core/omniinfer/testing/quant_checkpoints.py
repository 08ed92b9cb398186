"""GPTQ, AWQ and compressed-tensors checkpoints made from a float one, for tests and benchmarks.

`write_quantized(float_dir, out_dir, scheme)` quantises every decoder linear layer of a float
checkpoint (round to nearest, :mod:`.quant_weights`), writes the format's tensors and its
``quantization_config`` to `out_dir`, and, with `reference_dir`, the float checkpoint whose
linear weights are the exact values the quantised ones stand for: what transformers runs as the
reference (it cannot load GPTQ/AWQ here without their CUDA packages)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

import torch

from omniinfer.testing import quant_weights as qw

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Scheme:
    """One checkpoint format: `method` "gptq", "awq", "ct" (pack-quantized), "ct-w8a8", "fp8"
    (transformers' fine-grained FP8: `block` (bn, bk) or, None, a scale a tensor with a static
    input scale, as neuralmagic's first FP8 models) or "ct-fp8" (float-quantized: `block`, or
    group_size -1 for a scale a channel, else one a tensor)."""

    method: str
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    act_order: bool = False
    v1: bool = True  # GPTQ: qzeros hold zero - 1
    static: bool = False  # ct-w8a8: a static input scale
    block: tuple[int, int] | None = None  # fp8 / ct-fp8: [rows, columns] a scale

    @property
    def label(self) -> str:
        if self.method in ("fp8", "ct-fp8"):
            how = f"b{self.block[0]}x{self.block[1]}" if self.block else "channel" if self.group_size == -1 else "tensor"
            return f"{self.method}-{how}"
        parts = [self.method, f"{self.bits}b", f"g{self.group_size}", "sym" if self.sym else "asym"]
        parts += ["act"] if self.act_order else []
        parts += ["v2"] if self.method == "gptq" and not self.v1 else []
        parts += ["static"] if self.static else []
        return "-".join(parts)

    def config(self) -> dict:
        if self.method == "fp8":
            if self.block:
                return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                        "weight_block_size": list(self.block)}
            return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
        if self.method == "ct-fp8":
            strategy = "block" if self.block else "channel" if self.group_size == -1 else "tensor"
            weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
                       "block_structure": list(self.block) if self.block else None}
            acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                    "strategy": "group" if self.block else "token", "group_size": 128 if self.block else None}
            return {"quant_method": "compressed-tensors", "format": "float-quantized",
                    "quantization_status": "compressed", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                  "input_activations": acts}}}
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size,
                    "sym": self.sym, "desc_act": self.act_order,
                    "checkpoint_format": "gptq" if self.v1 else "gptq_v2", "damp_percent": 0.01}
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm"}
        if self.method == "ct":
            weights = {"num_bits": self.bits, "type": "int", "symmetric": self.sym,
                       "strategy": "channel" if self.group_size == -1 else "group",
                       "group_size": None if self.group_size == -1 else self.group_size,
                       "actorder": "group" if self.act_order else None, "dynamic": False}
            return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                    "quantization_status": "compressed", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                  "input_activations": None}}}
        acts = {"num_bits": 8, "type": "int", "symmetric": True,
                "strategy": "tensor" if self.static else "token", "dynamic": not self.static}
        return {"quant_method": "compressed-tensors", "format": "int-quantized",
                "quantization_status": "compressed", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": acts,
                                              "weights": {"num_bits": 8, "type": "int",
                                                          "symmetric": True, "strategy": "channel"}}}}


def _layer(weight: torch.Tensor, scheme: Scheme, seed: int) -> tuple[dict, torch.Tensor]:
    if scheme.method == "fp8":
        return qw.fp8_tensors(weight, scheme.block, "tensor", "weight_scale_inv" if scheme.block else "weight_scale",
                              static_input_scale=None if scheme.block else 0.02)
    if scheme.method == "ct-fp8":
        strategy = "channel" if scheme.group_size == -1 else "tensor"
        return qw.fp8_tensors(weight, scheme.block, strategy, "weight_scale", torch.bfloat16)
    if scheme.method == "ct-w8a8":
        return qw.ct_int8_tensors(weight, 0.05 if scheme.static else None)
    q = qw.rtn(weight, scheme.bits, scheme.group_size, scheme.sym, scheme.act_order,
               torch.float16, seed)
    if scheme.method == "gptq":
        tensors = qw.gptq_tensors(q, scheme.bits, scheme.v1)
    elif scheme.method == "awq":
        tensors = qw.awq_tensors(q)
    else:
        tensors = qw.ct_packed_tensors(q, scheme.bits, scheme.sym, scheme.act_order)
    return tensors, q.expected


def write_quantized(float_dir: str, out_dir: str, scheme: Scheme, reference_dir: str | None = None) -> str:
    from safetensors.torch import load_file, save_file

    state = {}
    for name in sorted(os.listdir(float_dir)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(float_dir, name)))
    quantized, reference = {}, {}
    for i, (name, t) in enumerate(sorted(state.items())):
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in LINEARS:
            tensors, expected = _layer(t, scheme, seed=i)
            quantized.update({f"{prefix}.{k}": v.contiguous() for k, v in tensors.items()})
            reference[name] = expected.to(t.dtype)
        else:
            quantized[name] = reference[name] = t
    for target, tensors, qconfig in ((out_dir, quantized, scheme.config()), (reference_dir, reference, None)):
        if target is None:
            continue
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(float_dir):
            if not name.endswith((".safetensors", ".safetensors.index.json")):
                shutil.copy(os.path.join(float_dir, name), target)
        save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
        if qconfig is not None:
            with open(os.path.join(target, "config.json"), encoding="utf-8") as f:
                config = json.load(f)
            config["quantization_config"] = qconfig
            with open(os.path.join(target, "config.json"), "w", encoding="utf-8") as f:
                json.dump(config, f, indent=2)
    return out_dir
