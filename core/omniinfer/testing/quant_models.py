"""Quantised models end to end on one platform, against transformers on the same weights: the
GPU check's model-level step (the kernel micro-benchmark multiplies tensors it made itself; this
loads files as a user does, so the loader, the device placement and the kernels' choice are in
it too).

    python -m omniinfer.testing.quant_models [--platform cuda] [--case NAME ...] [--json out.json]

A tiny random llama (float32, 256 wide so that the K-quants' 256-blocks fit, initializer_range
0.1) is written as GGUF files (q4_k_m: Q4_K with Q6_K; q5_1; q8_0; q3_k_m: Q3_K with Q4_K, Q5_K and
Q6_K; iq4_xs: IQ4_XS with Q6_K) and as GPTQ (4 bits, group 64,
asymmetric, act-order) and AWQ (group 32) checkpoints; a tiny Qwen3-MoE (8 experts, top 2) as a
q4_k_m file, its experts run quantised (quantization/experts.py). Each is served in float32 on the platform
and its greedy tokens compared with transformers' (on the CPU: for GGUF, `from_pretrained(...,
gguf_file=...)`, which dequantises the file; for GPTQ/AWQ and the MoE file the float checkpoint
of the exact dequantised weights): equal, or differing first where transformers' two best tokens were within
`testing.greedy.NEAR_TIE` of each other (int8 activations on the CPU round differently). Prints
one row per case: the kernels its layers ran, tokens agreed, decode ms/token. Exit status 1
when a case fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

PROMPTS = [[1, 5, 9, 33, 7, 20], list(range(40, 75))]
STEPS = 12
CASES = ("gguf-q4_k_m", "gguf-q5_1", "gguf-q8_0", "gguf-q3_k_m", "gguf-iq4_xs", "gptq-4b-g64-asym-act",
         "awq-4b-g32-asym", "moe-q4_k_m")


def _build(root: str, case: str) -> tuple[str, str, str | None]:
    """(what to serve, transformers' directory, its gguf_file or None) for one case."""
    from omniinfer.benchmarks.gguf_export import export
    from omniinfer.testing.quant_checkpoints import Scheme, write_quantized
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    float_dir = os.path.join(root, "float")
    if not os.path.isdir(float_dir):
        build_tiny_checkpoint(float_dir, "llama", hidden_size=256, intermediate_size=512,
                              vocab_size=1000, seed=7)
    method, _, rest = case.partition("-")
    if method == "moe":  # (transformers reads no MoE routing from a file: its dequantised weights instead)
        from omniinfer.testing.greedy import dequantized_checkpoint

        moe_dir = os.path.join(root, "moe")
        if not os.path.isdir(moe_dir):
            build_tiny_checkpoint(moe_dir, "qwen3_moe", hidden_size=256, intermediate_size=256, vocab_size=1000,
                                  seed=7, num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                  norm_topk_prob=True)
        path = export(moe_dir, os.path.join(moe_dir, f"{rest}.gguf"), rest)
        return path, dequantized_checkpoint(path, moe_dir, os.path.join(root, f"{case}-ref")), None
    if method == "gguf":
        path = export(float_dir, os.path.join(float_dir, f"{rest}.gguf"), rest)
        return path, float_dir, os.path.basename(path)
    scheme = (Scheme("gptq", 4, 64, sym=False, act_order=True) if method == "gptq"
              else Scheme("awq", 4, 32, sym=False))
    out, ref = os.path.join(root, case), os.path.join(root, case + "-ref")
    write_quantized(float_dir, out, scheme, ref)
    return out, ref, None


def run_case(root: str, case: str, platform: str | None) -> dict:
    from omniinfer import LLM, SamplingParams
    from omniinfer.testing.greedy import agreed_steps, hf_greedy, kernel_names

    row = dict(case=case)
    try:
        served, ref_dir, gguf_file = _build(root, case)
        want = hf_greedy(ref_dir, PROMPTS, STEPS, gguf_file)  # (on the CPU)
        llm = LLM(served, dtype="float32", num_kv_blocks=64, device=platform)
        try:
            row["platform"] = llm.llm_engine.executor.worker.model_runner.device.type
            row["kernels"] = sorted(kernel_names(llm))
            params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
            prompts = [{"prompt_token_ids": p} for p in PROMPTS]
            llm.generate(prompts, params, use_tqdm=False)  # warm: graphs, kernels compiled
            t0 = time.perf_counter()
            outs = llm.generate(prompts[:1], params, use_tqdm=False)
            row["ms_per_token"] = (time.perf_counter() - t0) * 1e3 / STEPS
            outs += llm.generate(prompts[1:], params, use_tqdm=False)
        finally:
            llm.shutdown()
        agreed = [agreed_steps(o.outputs[0].token_ids, steps)
                  for o, (_, steps) in zip(outs, want)]
        row["agreed"] = f"{sum(agreed)}/{STEPS * len(PROMPTS)}"
        row["ok"] = True
    except Exception as e:  # one case's failure must not hide the others
        row["failed"] = f"{type(e).__name__}: {e}"[:300]
        row["ok"] = False
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platform", default=None, help="platform name (default: the best here)")
    parser.add_argument("--case", action="append", default=[], choices=CASES)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="omniinfer-quant-models-") as root:
        rows = [run_case(root, case, args.platform) for case in args.case or CASES]
    print(f"quantized models end to end (tiny llama and Qwen3-MoE, float32, {STEPS} greedy steps x "
          f"{len(PROMPTS)} prompts, against transformers)")
    print(f"{'case':<22} {'platform':<8} {'agreed':>7} {'ms/tok':>7}  kernels")
    for r in rows:
        if not r["ok"]:
            print(f"{r['case']:<22} FAILED: {r['failed']}")
            continue
        print(f"{r['case']:<22} {r['platform']:<8} {r['agreed']:>7} {r['ms_per_token']:>7.1f}  "
              f"{', '.join(r['kernels'])}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
