"""A vLLM user's launch line and dashboards: vLLM's flag names, `--metrics-prefix vllm` with the
series vLLM exports (names, types, buckets), requests counted as requests."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_openai_server import call, make_engine, wait_idle
from test_serve_socket import CONSOLE_SCRIPT, free_port

from omniinfer import LLM, SamplingParams
from omniinfer.entrypoints.cli import build_parser
from omniinfer.entrypoints.engine_flags import engine_kwargs
from omniinfer.entrypoints.openai.api_server import ServerState
from omniinfer.entrypoints.openai.metrics import ServerMetrics, buckets_1_2_5

VLLM_LINE = ["--gpu-memory-utilization", "0.85", "--disable-log-requests", "-tp", "1",
             "--trust-remote-code", "--max-logprobs", "5", "--disable-log-stats",
             "--no-enable-prefix-caching", "--enable-log-requests", "--metrics-prefix", "vllm",
             "--kv-cache-dtype", "auto", "--tokenizer-mode", "auto", "--generation-config", "vllm",
             "--override-generation-config", '{"top_k": 1}', "--guided-decoding-backend", "xgrammar",
             "--allowed-origins", '["https://ui.example"]', "--root-path", "/proxy"]


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_a_vllm_launch_line_parses_to_engine_arguments():
    args = build_parser().parse_args(["serve", "--model", "/m", *VLLM_LINE])
    kwargs = engine_kwargs(args)
    assert args.model_flag == "/m" and args.metrics_prefix == "vllm"
    assert (kwargs["gpu_memory_utilization"], kwargs["tensor_parallel_size"]) == (0.85, 1)
    assert (kwargs["trust_remote_code"], kwargs["max_logprobs"]) == (True, 5)
    assert kwargs["enable_prefix_caching"] is False and args.disable_log_stats
    assert args.enable_log_requests is True  # the later flag wins, as in argparse
    later = build_parser().parse_args(["serve", "m", "--enable-log-requests",
                                       "--disable-log-requests", "--enable-prefix-caching",
                                       "-pp", "2"])
    assert later.enable_log_requests is False and engine_kwargs(later)["enable_prefix_caching"]
    assert engine_kwargs(later)["pipeline_parallel_size"] == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--metrics-prefix", "tgi"])


@pytest.mark.parametrize("flags, match", [
    (["--guided-decoding-backend", "outlines"], "--guided-decoding-backend='outlines' is not supported; "
                                                "allowed: auto, xgrammar"),
    (["--structured-outputs-config", '{"backend": "guidance"}'], "backend='guidance' is not supported"),
    (["--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}'],
     "holds 'disable_any_whitespace'; the one key allowed is 'backend'"),
    (["--override-generation-config", '{"max_new_tokens": 5}'],
     "holds 'max_new_tokens'; allowed: temperature, top_p, top_k, min_p, repetition_penalty"),
    (["--override-generation-config", '{"temperature": -1}'], "temperature=-1.0 is not allowed"),
    (["--generation-config", "/nonexistent"], "'/nonexistent': no generation_config.json there"),
    (["--ssl-keyfile", "/nonexistent", "--ssl-certfile", "/nonexistent"], "--ssl-keyfile '/nonexistent': no such file"),
])
def test_vllm_serving_flags_we_cannot_honour_are_named(flags, match):
    from omniinfer.entrypoints.openai.protocol import GENERATION_DEFAULTS
    from omniinfer.entrypoints.serve_options import serve_options

    args = build_parser().parse_args(["serve", "m", *flags])
    with pytest.raises(ValueError, match=re.escape(match)):
        serve_options(args, GENERATION_DEFAULTS)


@pytest.mark.parametrize("name, value", [("kv_cache_dtype", "fp8"), ("tokenizer_mode", "mistral")])
def test_engine_values_only_vllm_has_are_refused(name, value, checkpoint_dir):
    with pytest.raises(ValueError, match=f"{name}={value!r} is not supported; allowed: 'auto'"):
        LLM(checkpoint_dir("llama"), **{name: value})


def test_generation_config_sources(checkpoint_dir, tmp_path):
    """'auto': the checkpoint's generation_config.json; 'vllm': none; a directory: its file;
    the overrides over each."""
    from omniinfer.entrypoints.openai.protocol import GENERATION_DEFAULTS
    from omniinfer.entrypoints.serve_options import GenerationOptions

    checkpoint = {"temperature": 0.3, "top_k": 5, "do_sample": True, "max_length": 20}
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    cases = [(GenerationOptions("auto"), {"temperature": 0.3, "top_k": 5}),
             (GenerationOptions("vllm"), {}),
             (GenerationOptions(str(other)), {"top_p": 0.5}),
             (GenerationOptions("auto", {"top_k": 1}), {"temperature": 0.3, "top_k": 1})]
    for options, expected in cases:
        assert options.defaults(checkpoint, GENERATION_DEFAULTS) == expected
    state = ServerState("tiny", stats_interval_s=0, generation=GenerationOptions("vllm", {"min_p": 0.1}))
    state.attach(make_engine(checkpoint_dir("llama")))
    try:
        assert state.ctx.generation_defaults == {"min_p": 0.1}
    finally:
        state.shutdown()


def test_vllm_launch_line_serves_over_a_socket(checkpoint_dir, tmp_path):
    """`omniinfer serve --model X` with vLLM's flags, each with its effect."""
    log = tmp_path / "server.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNIINFER_")}
    env["OMNIINFER_CPU_THREADS"] = "1"
    command = [str(CONSOLE_SCRIPT), "serve", "--model", checkpoint_dir("llama"), "--port",
               str(port), "--served-model-name", "tiny", "--num-kv-blocks", "64",
               "--max-model-len", "256", "--stats-interval", "0.2", *VLLM_LINE]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        client = openai.OpenAI(api_key="unused", base_url=f"{url}/v1", max_retries=0)
        assert client.models.retrieve("tiny").id == "tiny"
        for _ in range(2):  # the same prompt twice: no prefix cache, no hit
            r = client.completions.create(model="tiny", prompt="Return the number of items in "
                                          "the list", max_tokens=3, echo=True, logprobs=5)
            assert r.choices[0].logprobs.token_logprobs[0] is None
        with pytest.raises(openai.BadRequestError, match="max_logprobs=5"):
            client.completions.create(model="tiny", prompt="hi", max_tokens=1, logprobs=6)
        # --allowed-origins: a browser's preflight from that origin is allowed, another's not
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        ok = httpx.options(f"{url}/v1/completions", headers={"Origin": "https://ui.example", **preflight})
        other = httpx.options(f"{url}/v1/completions", headers={"Origin": "https://evil.example", **preflight})
        assert ok.headers["access-control-allow-origin"] == "https://ui.example"
        assert "access-control-allow-origin" not in other.headers
        # --root-path: a proxy serves the app under /proxy and strips it; the paths it forwards
        # are the app's own (the log line names the public address)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
        # --override-generation-config top_k 1: sampling at temperature 1 is greedy
        texts = {client.completions.create(model="tiny", prompt="Return the", max_tokens=6,
                                           temperature=1.0).choices[0].text for _ in range(3)}
        greedy = client.completions.create(model="tiny", prompt="Return the", max_tokens=6, temperature=0)
        assert texts == {greedy.choices[0].text}
        time.sleep(1.0)  # several stats intervals
        text = httpx.get(f"{url}/metrics").text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    found = families(text)
    assert "vllm:num_requests_running" in found and not any(n.startswith("omniinfer:") for n in found)
    samples = {s.name: s.value for f in found.values() for s in f.samples}
    assert samples["vllm:prefix_cache_queries_total"] == 0  # --no-enable-prefix-caching
    assert samples["vllm:request_success_total"] >= 6
    output = log.read_text()
    assert output.count("prompt tokens [") == 6, output  # --enable-log-requests: one per request queued
    assert "prompt throughput" not in output  # --disable-log-stats
    assert f"at http://127.0.0.1:{port}/proxy/v1" in output


# ---- metrics: names, types and buckets as vLLM's; requests counted as requests ------------------
VLLM_HISTOGRAMS = {
    "time_to_first_token_seconds": None, "inter_token_latency_seconds": None,
    "e2e_request_latency_seconds": None,
    "time_per_output_token_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                                      0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "request_queue_time_seconds": None, "request_prefill_time_seconds": None,
    "request_decode_time_seconds": None, "request_inference_time_seconds": None,
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "request_params_n": [1, 2, 5, 10, 20],
    "request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100],  # up to max_model_len (128)
    "request_generation_tokens": [1, 2, 5, 10, 20, 50, 100],
}
VLLM_COUNTERS = ("prompt_tokens", "generation_tokens", "num_preemptions", "prefix_cache_queries",
                 "prefix_cache_hits", "request_success")
VLLM_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")


def test_vllm_prefixed_series_and_their_values(checkpoint_dir):
    state = ServerState("tiny", stats_interval_s=0, metrics_prefix="vllm")
    state.attach(make_engine(checkpoint_dir("llama")))
    prompt = [5, 17, 33, 2, 90, 41, 7]
    try:
        async def run(client, http):
            await client.completions.create(model="tiny", prompt=prompt, max_tokens=4, n=3,
                                            temperature=1.0, seed=1,
                                            extra_body={"ignore_eos": True})
            return (await http.get("/metrics")).text

        text = call(state, run)
        wait_idle(state)
    finally:
        state.shutdown()
    found = families(text)
    for name, buckets in VLLM_HISTOGRAMS.items():
        family = found[f"vllm:{name}"]
        assert family.type == "histogram", name
        if buckets is not None:
            bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
            assert bounds == [*map(float, buckets), float("inf")], name
    for name in VLLM_COUNTERS:
        assert found[f"vllm:{name}"].type == "counter", name
    for name in VLLM_GAUGES:
        assert found[f"vllm:{name}"].type == "gauge", name
    value = {s.name: s.value for f in found.values() for s in f.samples if "le" not in s.labels
             and "finished_reason" not in s.labels}
    assert value["vllm:request_params_n_sum"] == 3 and value["vllm:request_params_n_count"] == 1
    assert value["vllm:request_prompt_tokens_sum"] == len(prompt)
    assert value["vllm:request_generation_tokens_sum"] == 3 * 4
    # the prompt once (its 3 samples drawn from the same logits), then 3 decode steps of 3 rows
    assert value["vllm:iteration_tokens_total_sum"] == len(prompt) + 3 * 3
    assert value["vllm:time_per_output_token_seconds_count"] == 3 * 3
    for phase in ("queue", "prefill", "decode", "inference"):
        assert value[f"vllm:request_{phase}_time_seconds_count"] == 1
    assert value["vllm:request_decode_time_seconds_sum"] <= value[
        "vllm:request_inference_time_seconds_sum"]


def test_running_and_waiting_count_requests_not_sequences(checkpoint_dir):
    engine = make_engine(checkpoint_dir("llama"), max_num_seqs=4)
    engine.add_request("three", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(n=3, max_tokens=8, ignore_eos=True, seed=0))
    engine.add_request("one", {"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=8))
    engine.step()  # "three" forks into 3 sequences
    engine.add_request("queued", {"prompt_token_ids": [10]}, SamplingParams(max_tokens=8))
    stats = engine.stats()
    assert (stats["num_running"], stats["num_running_requests"]) == (4, 2)
    assert (stats["num_waiting"], stats["num_waiting_requests"]) == (1, 1)
    metrics = ServerMetrics("m", stats_fn=lambda: stats, prefix="vllm")
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode())
               for s in f.samples}
    assert samples["vllm:num_requests_running"] == 2 and samples["vllm:num_requests_waiting"] == 1
    engine.abort_request(["three", "one", "queued"])


def test_buckets_and_prefix_are_checked():
    assert buckets_1_2_5(128) == [1, 2, 5, 10, 20, 50, 100]
    with pytest.raises(ValueError, match="metrics_prefix='tgi' is not allowed; allowed: "
                                         "omniinfer, vllm"):
        ServerMetrics("m", prefix="tgi")
