"""Decode graphs (worker/graph_runner.py) without a GPU: the CPU platform declares graph capture
here and "capture" runs the forward pass again on replay, so everything but the device graph
itself is exercised: padded batch sizes, static buffers refreshed per step, padding rows writing
nowhere, the eager fallbacks."""

from __future__ import annotations

import contextlib
import logging
import random

import pytest
import torch

from omniinfer import LLM, SamplingParams
from omniinfer.engine.scheduler import Scheduler
from omniinfer.worker.graph_runner import capture_with, graph_batch_sizes
from omniinfer.worker.model_runner import ModelRunner
from omniinfer_cpu.platform import CpuPlatform


class Replaying:
    """A "graph" that re-runs the captured function (same buffers, same effects)."""

    captured: list[int] = []
    replays = 0

    @staticmethod
    def capture_graph(runner, fn):
        out = fn()
        Replaying.captured.append(out.shape[0])

        def replay():
            Replaying.replays += 1
            out.copy_(fn())

        return replay, out


@pytest.fixture
def replaying_runner(monkeypatch):
    """The CPU platform declares graph capture, and the core runner captures with `Replaying`."""
    monkeypatch.setattr(CpuPlatform, "supports_graph_capture", True)
    monkeypatch.setattr(ModelRunner, "capture_graph", Replaying.capture_graph)
    monkeypatch.setattr(Replaying, "captured", [])
    monkeypatch.setattr(Replaying, "replays", 0)
    return Replaying


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(36) == [1, 2, 4, 8, 16, 24, 32, 36]
    assert graph_batch_sizes(10_000)[-2:] == [504, 512]


def _generate(path, prompts, **kwargs):
    llm = LLM(path, block_size=8, num_kv_blocks=48, max_num_batched_tokens=16, max_num_seqs=6,
              **kwargs)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_replayed_decodes_match_transformers(checkpoint_dir, hf_greedy, replaying_runner):
    path = checkpoint_dir("mistral_window")  # sliding window 24: the window reaches the cache
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (27, 3, 12)]
    llm, tokens = _generate(path, prompts, attention_backend="TRITON")
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(path, prompt, 6)
    runner = llm.llm_engine.executor.worker.model_runner
    assert sorted(replaying_runner.captured) == [1, 2, 4, 6] == runner.graphs.sizes
    assert replaying_runner.replays >= 5  # 3 running sequences replay the size-4 graph


def test_multi_step_decodes_replay_the_graphs(checkpoint_dir, hf_greedy, replaying_runner,
                                              monkeypatch):
    """Every step of a multi-step run replays a graph from inputs advanced without the builder."""
    runs = []
    schedule = Scheduler.schedule

    def recording(self):
        out = schedule(self)
        runs.append(out.num_steps)
        return out

    monkeypatch.setattr(Scheduler, "schedule", recording)
    path = checkpoint_dir("mistral_window")
    rng = random.Random(6)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (27, 3, 12)]
    llm, tokens = _generate(path, prompts, attention_backend="TRITON", num_scheduler_steps=3)
    for prompt, got in zip(prompts, tokens):
        assert got == hf_greedy(path, prompt, 6)
    assert 3 in runs and replaying_runner.replays >= 5


def test_enforce_eager_and_unsupported_backends_run_eagerly(checkpoint_dir, replaying_runner, caplog):
    path = checkpoint_dir("llama")
    prompts = [[5, 6, 7, 8], [9, 10]]
    with caplog.at_level(logging.INFO, logger="omniinfer"):
        llm, eager = _generate(path, prompts, attention_backend="TRITON", enforce_eager=True)
        _, sdpa = _generate(path, prompts, attention_backend="TORCH_SDPA")
    assert llm.llm_engine.config.device.enforce_eager is True
    assert replaying_runner.captured == [] and replaying_runner.replays == 0
    assert eager == sdpa
    messages = [r.getMessage() for r in caplog.records]
    assert "decode steps run eagerly: enforce_eager=True" in messages
    assert ("decode steps run eagerly: attention backend TORCH_SDPA does not support graph capture"
            in messages)


def test_moe_layers_that_read_their_routing_on_the_host_decode_eagerly(tmp_path, replaying_runner, caplog):
    """Quantised experts (and the torch reference) read which experts were hit on the host: a
    device graph cannot hold that, so such a model's decodes run eagerly, saying why."""
    from omniinfer.benchmarks.gguf_export import export
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    ckpt = build_tiny_checkpoint(str(tmp_path / "moe"), "qwen3_moe", hidden_size=64, num_local_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=64)
    path = export(ckpt, str(tmp_path / "q8_0.gguf"), "q8_0")
    with caplog.at_level(logging.INFO, logger="omniinfer"):
        _generate(path, [[5, 6, 7, 8]], tokenizer=ckpt, attention_backend="TRITON")
    assert replaying_runner.captured == [] and replaying_runner.replays == 0
    assert ("decode steps run eagerly: mixture-of-experts layers run quantised experts, which reads the "
            "routing on the host" in [r.getMessage() for r in caplog.records])


def test_capture_with_follows_the_cuda_graph_protocol():
    """The sequence the core runner relies on for CUDA and ROCm: warm up on a side stream,
    capture into the shared pool, hand back replay and the pool."""
    events = []

    class Stream:
        def wait_stream(self, other):
            events.append(("wait", type(other).__name__))

    class Graph:
        def replay(self):
            events.append("replay")

        def pool(self):
            return "pool-2"

    @contextlib.contextmanager
    def stream(s):
        events.append("side stream")
        yield

    @contextlib.contextmanager
    def graph(g, pool=None):
        events.append(("capture", pool))
        yield

    api = type("api", (), dict(Stream=Stream, stream=staticmethod(stream), CUDAGraph=Graph,
                              graph=staticmethod(graph), current_stream=staticmethod(Stream)))
    out = torch.zeros(2)

    def fn():
        events.append("forward")
        return out

    replay, result, pool = capture_with(api, fn, pool="pool-1")
    assert result is out and pool == "pool-2"
    replay()
    assert events == [("wait", "Stream"), "side stream", "forward", ("wait", "Stream"),
                      ("capture", "pool-1"), "forward", "replay"]
