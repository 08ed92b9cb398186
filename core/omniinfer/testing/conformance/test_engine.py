"""Greedy output through the whole engine, against transformers."""

from __future__ import annotations

import random

import torch

MAX_TOKENS = 6


def test_greedy_parity_with_transformers(conformance, conformance_backend, conformance_checkpoint,
                                         transformers_greedy):
    from omniinfer import LLM, SamplingParams

    dtype = conformance.runnable[conformance_backend]
    rng = random.Random(7)
    prefix = [rng.randrange(3, 300) for _ in range(16)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (19, 3)] + [prefix + [5, 6, 7]]
    prompts.append(prefix + [9])  # a prefix-cache hit
    llm = LLM(conformance_checkpoint, device=conformance.platform.name,
              attention_backend=conformance_backend, dtype=str(dtype).removeprefix("torch."),
              block_size=16, num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        expected = transformers_greedy(conformance_checkpoint, prompt, MAX_TOKENS)
        got = out.outputs[0].token_ids
        if dtype == torch.float32:
            assert got == expected, f"prompt of {len(prompt)} tokens diverged"
        else:  # half precision: the first token must agree with the float32 reference
            assert got[:1] == expected[:1], f"prompt of {len(prompt)} tokens: {got} vs {expected}"
    stats = llm.llm_engine.stats()
    assert stats["num_free_kv_blocks"] == stats["num_total_kv_blocks"], "blocks leaked"
