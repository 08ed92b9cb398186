"""All-greedy steps take their tokens straight from the LM head (`ModelRunner.tokens_from_lm_head`,
`LinearMethod.apply_argmax`), which a platform may do without writing the logits: which steps
do, that they give transformers' tokens, and the core's default for the hook."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omniinfer import LLM, SamplingParams
from omniinfer.models.layers.embedding import ParallelLMHead
from omniinfer.models.layers.linear import LinearMethod
from omniinfer.sampling.sampler import greedy_tokens


class _Layer(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


def test_the_default_hook_is_the_argmax_of_the_product():
    gen = torch.Generator().manual_seed(0)
    layer = _Layer(torch.randn(50, 16, generator=gen))
    x = torch.randn(5, 16, generator=gen)
    got = LinearMethod().apply_argmax(layer, x, greedy_tokens)
    assert got.tolist() == F.linear(x, layer.weight).argmax(-1).tolist()


def test_the_lm_head_asks_its_linear_method():
    calls = []

    class Recording(LinearMethod):
        def apply_argmax(self, layer, x, argmax_rows):
            calls.append(x.shape[0])
            return super().apply_argmax(layer, x, argmax_rows)

    head = ParallelLMHead(50, 16)
    head.weight.data = torch.randn(50, 16, generator=torch.Generator().manual_seed(1))
    head.linear_method = Recording()
    hidden = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    tokens = head.greedy_tokens(hidden, greedy_tokens)
    assert tokens.tolist() == head.compute_logits(hidden).argmax(-1).tolist() and calls == [4]


def test_only_plain_greedy_steps_skip_the_logits(checkpoint_dir, hf_greedy):
    """Three greedy requests: every step (the prefill, then the decodes) takes its tokens from
    the LM head, and they are transformers'. A request that needs the logits (log-probs, random
    sampling, a penalty) sends every step it is in through them, prompt log-probs the prefill
    only, and the greedy requests beside it keep transformers' tokens."""
    path = checkpoint_dir("llama")
    llm = LLM(path, num_kv_blocks=64)
    runner = llm.llm_engine.executor.worker.model_runner
    decisions, rows = [], []
    decide, compute = runner.tokens_from_lm_head, runner.model.compute_greedy_tokens
    runner.tokens_from_lm_head = lambda model_input: decisions.append(decide(model_input)) or decisions[-1]
    runner.model.compute_greedy_tokens = lambda hidden, argmax: rows.append(hidden.shape[0]) or compute(hidden, argmax)
    prompts = [[5, 6, 7], list(range(10, 30)), [3, 4]]
    requests = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(requests, greedy, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6)
    assert decisions and all(decisions) and set(rows) == {3}
    for other in (dict(logprobs=2), dict(prompt_logprobs=1), dict(temperature=0.8, seed=1),
                  dict(repetition_penalty=1.2)):
        decisions.clear()
        params = SamplingParams(**{"temperature": 0, "max_tokens": 6, "ignore_eos": True, **other})
        outs = llm.generate(requests, [greedy, greedy, params], use_tqdm=False)
        if "prompt_logprobs" in other:
            assert outs[2].prompt_logprobs and decisions[0] is False and all(decisions[1:])
        else:
            assert decisions and not any(decisions), other
        for prompt, out in zip(prompts[:2], outs[:2]):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6), other
