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


def hf_greedy(path: str, prompts: list[list[int]], n: int, gguf_file: str | None = None
              ) -> list[tuple[list[int], list[torch.Tensor]]]:
    """transformers' greedy run of `n` tokens per prompt in float32 (the checkpoint in `path`, or
    its `gguf_file`, which transformers dequantises): (tokens, each step's log-probs)."""
    from transformers import AutoModelForCausalLM

    extra = {"gguf_file": gguf_file} if gguf_file else {}
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
