"""Plugin API 1.x runners, for the one minor version 2.0 adapts them (platforms/legacy.py): a
ModelRunner subclass's linear_method / layer_ops / decoder_stack still change the model, and a
GraphRunnerMixin runner's own capture_graph still captures the decode graphs."""

from __future__ import annotations

import pytest

from omniinfer import LLM, SamplingParams
from omniinfer.models.layers.layer_ops import LayerOps
from omniinfer.models.layers.linear import LinearMethod
from omniinfer.worker.graph_runner import GraphRunnerMixin
from omniinfer.worker.model_runner import ModelRunner
from omniinfer_cpu.platform import CpuPlatform

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


class CountingMethod(LinearMethod):
    calls = 0

    def apply(self, layer, x, bias=None):
        CountingMethod.calls += 1
        return super().apply(layer, x, bias)


class V1Runner(ModelRunner):
    """What a 1.x platform's runner looked like: the three load-time hooks as its methods."""

    seen: list[str] = []

    def linear_method(self, layer):
        V1Runner.seen.append(type(layer).__name__)
        return CountingMethod()

    def layer_ops(self):
        V1Runner.seen.append("layer_ops")
        return LayerOps()

    def decoder_stack(self, layers):
        V1Runner.seen.append(f"decoder_stack of {len(layers)}")
        return None


class V1GraphRunner(GraphRunnerMixin, ModelRunner):
    """A 1.x CUDA-style runner: its own capture_graph (here one that re-runs the function)."""

    captured: list[int] = []

    def capture_graph(self, fn):
        out = fn()
        V1GraphRunner.captured.append(out.shape[0])
        return (lambda: out.copy_(fn())), out


@pytest.fixture
def runner_cls(monkeypatch):
    def use(cls):
        monkeypatch.setattr(CpuPlatform, "model_runner_cls", classmethod(lambda platform: cls))
        return cls

    monkeypatch.setattr(V1Runner, "seen", [])
    monkeypatch.setattr(V1GraphRunner, "captured", [])
    monkeypatch.setattr(CountingMethod, "calls", 0)
    return use


def test_a_v1_runners_hooks_still_change_the_model(runner_cls, checkpoint_dir, hf_greedy):
    runner_cls(V1Runner)
    path = checkpoint_dir("llama")
    llm = LLM(path, num_kv_blocks=64)
    runner = llm.llm_engine.executor.worker.model_runner
    assert type(runner) is V1Runner and type(runner.transform).__name__ == "RunnerHooksTransform"
    assert {"QKVParallelLinear", "RowParallelLinear", "ParallelLMHead", "layer_ops",
            "decoder_stack of 2"} <= set(V1Runner.seen)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 5) for p in PROMPTS]
    assert CountingMethod.calls > 0


def test_a_v1_graph_runner_still_captures(runner_cls, checkpoint_dir, hf_greedy):
    runner_cls(V1GraphRunner)
    assert not CpuPlatform.supports_graph_capture  # the mixin alone turns graphs on (1.x)
    path = checkpoint_dir("llama")
    llm = LLM(path, num_kv_blocks=64, max_num_seqs=4, attention_backend="TRITON")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(path, p, 5) for p in PROMPTS]
    assert sorted(V1GraphRunner.captured) == [1, 2, 4]
