"""Comparing greedy runs with a reference that rounds differently (the CPU kernels' int8
activations): tokens equal up to a near-tie, where either of the reference's two best may win."""

from __future__ import annotations

import torch

# log-prob gap between the reference's two best tokens below which a step may go either way
NEAR_TIE = 0.15


def kernel_names(llm) -> set[str]:
    """The quantised-kernel names the model's layers run (e.g. "cpu (avx2, int8 activations)")."""
    model = llm.llm_engine.executor.worker.model_runner.model
    return {k for m in model.modules() for _, k, _ in getattr(m, "quant_choices", [])}


def hf_greedy(path: str, prompts: list[list[int]], n: int, gguf_file: str | None = None, config=None
              ) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy run of `n` tokens per prompt in float32 (the checkpoint in `path`, or
    its `gguf_file`, which transformers dequantises; `config`: that instead of the one
    transformers makes of the file): (tokens, each step's log-probs)."""
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    if config is not None:
        extra["config"] = config
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra)
    runs = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True)
            runs.append((out.sequences[0, len(prompt):].tolist(),
                         [torch.log_softmax(s[0].float(), -1) for s in out.scores]))
    return runs


def agreed_steps(tokens: list[int], steps: list[torch.Tensor], near_tie: float = NEAR_TIE) -> int:
    """How many leading tokens equal the reference's greedy ones (`steps`: its log-probs at each
    step of its own greedy run); at the first that differs, the reference must have ranked ours
    within `near_tie` of its best (AssertionError otherwise)."""
    for i, (ours, lp) in enumerate(zip(tokens, steps)):
        theirs = int(lp.argmax())
        if ours != theirs:
            margin = float(lp[theirs] - lp[ours])
            assert margin < near_tie, f"step {i}: {ours} instead of {theirs}, {margin:.4f} below it"
            return i
    return min(len(tokens), len(steps))


def dequantized_checkpoint(gguf_path: str, source: str, out: str) -> str:
    """A Hugging Face checkpoint in `out` of a GGUF file's weights as the `gguf` package
    dequantises them (float32), with `source`'s config and tokenizer: transformers then runs the
    file's numbers where it does not read the file itself (MoE files, whose experts transformers
    5 reads only for some families, and whose routing it does not take from the file). The names
    are omniinfer's reader's: the f32 file of the same checkpoint checks those on their own."""
    import os
    import shutil

    import gguf
    from safetensors.torch import save_file

    from omniinfer.quantization.base import QuantPiece
    from omniinfer.quantization.gguf_file import GGUFFile

    state = {}
    for name, tensor in GGUFFile(gguf_path).named_tensors():
        value = tensor.full()
        if isinstance(value, QuantPiece):
            blocks = value.tensors["blocks"].numpy()
            value = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[tensor.kind.name])
                                     .reshape(value.shape).astype("float32"))
        state[name] = value.float().contiguous()
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(source):
        if f.endswith(".json") and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(source, f), out)
    save_file(state, os.path.join(out, "model.safetensors"))
    return out
