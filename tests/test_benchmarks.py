"""The benchmark scripts run end to end (tiny shapes, seconds): numbers are not checked here,
only that every path works and the JSON and table come out."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *args: str, timeout: int = 300, **env_vars: str) -> str:
    """Run benchmarks/`script` (or, for "-c", the code that follows) with `args`; its stdout."""
    env = dict(os.environ, OMNIINFER_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1", **env_vars)
    command = [script] if script == "-c" else [os.path.join(ROOT, "benchmarks", script)]
    proc = subprocess.run([sys.executable, *command, *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


PEAK_RSS = """import resource, runpy, sys
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
print("peak rss kB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""  # runs a script given after it; prints the process's peak memory


def test_throughput_with_transformers_comparison(tmp_path):
    out = tmp_path / "t.json"
    text = run("-c", PEAK_RSS, os.path.join(ROOT, "benchmarks", "throughput.py"), "--shape", "tiny",
               "-n", "4", "--input-len", "8", "--output-len", "4", "--compare", "transformers",
               "--repeats", "2", "--json", str(out))
    # transformers' continuous batching gets a cache sized for the workload: on its own it takes
    # 60-90% of the machine's memory (~15 GB here)
    assert int(text.rsplit("peak rss kB", 1)[1]) < 4_000_000
    assert "MFU" in text and "transformers static" in text and "median of 2 runs" in text
    (result,) = json.loads(out.read_text())
    assert result["omniinfer"]["output_tokens_per_s"] > 0 and result["omniinfer"]["mfu"] > 0
    assert result["transformers_static"]["best_batch"] == 4  # fewer prompts than 8: one batch
    for key in ("omniinfer", "transformers_static", "transformers_continuous"):
        if key in result:  # continuous batching only where transformers has it
            runs = result[key]["runs_s"]
            assert len(runs) == 2 and min(runs) <= result[key]["seconds"] <= max(runs), key


def test_throughput_with_multi_step_decoding(tmp_path):
    """--num-scheduler-steps K: the K-step engine and the single-step one, in the same run."""
    out = tmp_path / "t.json"
    text = run("throughput.py", "--shape", "tiny", "-n", "4", "--input-len", "8", "--output-len", "6",
               "--num-scheduler-steps", "4", "--json", str(out))
    assert "omniinfer (4 steps)" in text and "omniinfer (1 step)" in text
    (result,) = json.loads(out.read_text())
    assert result["num_scheduler_steps"] == 4
    assert result["omniinfer"]["mfu"] > 0 and result["omniinfer_single_step"]["mfu"] > 0


def test_sampler_prompt_logprobs_mode(tmp_path):
    out = tmp_path / "p.json"
    text = run("sampler.py", "--vocab", "5000", "--prompt-logprobs", "300", "--top", "2", "--repeats", "1",
               "--json", str(out))
    assert "machine: " in text and "prompt log-probs of 300 rows (top 2)" in text
    (result,) = json.loads(out.read_text())
    lp = result["prompt_logprobs"]
    assert lp["rows"] == 300 and lp["top"] == 2 and lp["ms"] > 0 and lp["peak_growth_mb"] >= 0
    assert abs(lp["logits_mb"] - 301 * 5000 * 4 / 2**20) < 1e-6


@pytest.mark.parametrize("script,args,message", [
    ("throughput.py", ["--shape", "tiny", "--repeats", "0"],
     "--repeats 0: expected a positive number of runs"),
    ("throughput.py", ["--shape", "tiny", "--num-scheduler-steps", "0"],
     "--num-scheduler-steps 0: expected a positive number"),
    ("host_overhead.py", ["--num-scheduler-steps", "-1"], "--num-scheduler-steps -1: expected a positive"),
    ("engine_ops.py", ["--shape", "tiny", "--repeats", "0"], "--repeats 0: expected a positive number"),
    ("engine_ops.py", ["--shape", "tiny", "--num-prompts", "0"], "--num-prompts 0: expected a positive number"),
    ("cpu_gemm.py", ["--shape", "tiny", "--rows", "2"], "at least 3 rows"),
    ("latency.py", ["--shape", "tiny", "--output-len", "1"],
     "--output-len 1: ms per output token needs at least 2 tokens"),
    ("sampler.py", ["--rows", "0"], "--rows [0] / --scale [3.0, 8.0]: expected positive numbers"),
    ("sampler.py", ["--prompt-logprobs", "0"], "--prompt-logprobs 0: expected a positive number"),
    ("sampler.py", ["--prompt-logprobs", "8", "--top", "-1"], "--top -1: expected 0 or more"),
])
def test_bad_arguments_are_refused(script, args, message):
    env = dict(os.environ, OMNIINFER_LOG_LEVEL="WARNING")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]


def test_latency_with_transformers_comparison(tmp_path):
    out = tmp_path / "l.json"
    text = run("latency.py", "--shape", "tiny", "--input-len", "8", "--output-len", "4", "--repeats", "1",
               "--compare", "transformers", "--json", str(out))
    assert "ms/token" in text and "speed-up over transformers" in text and "round by round" in text
    (result,) = json.loads(out.read_text())
    assert result["read_gbps"] > 0 and result["omniinfer"]["weight_gbps"] > 0
    # the two took turns, with the machine's read bandwidth measured in each round
    assert len(result["read_gbps_rounds"]) == len(result["speedup_rounds"]) == 1
    assert result["read_gbps_rounds"][0] > 0 and result["transformers"]["ms_per_token"] > 0
    assert result["omniinfer"]["read_fraction"] > 0 and result["read_bound_ms_per_token"] > 0
    assert "the weights alone at the rounds' median read bandwidth" in text


def test_latency_of_an_fp8_copy_against_its_float_checkpoint(tmp_path):
    """--fp8: the checkpoint written as an FP8 one runs in turns with the float one; the weight
    bytes are the FP8 files' (e4m3 linear weights, float embedding), the float run's its own."""
    out = tmp_path / "l.json"
    text = run("latency.py", "--shape", "tiny", "--input-len", "8", "--output-len", "4", "--repeats", "2",
               "--fp8", "--json", str(out))
    assert "fp8 e4m3 b128, float32 activations" in text and "speed-up over omniinfer float" in text
    (result,) = json.loads(out.read_text())
    assert len(result["speedup_rounds_float"]) == 2 and result["omniinfer float"]["ms_per_token"] > 0
    assert 0 < result["weight_bytes"] < result["float_weight_bytes"]


def test_host_overhead(tmp_path):
    out = tmp_path / "h.json"
    text = run("host_overhead.py", "--seqs", "4", "16", "--steps", "3", "--json", str(out))
    assert "ms/step" in text and "8 decode steps per engine step" in text  # the LLM default
    assert [(r["num_seqs"], r["num_scheduler_steps"]) for r in json.loads(out.read_text())] == [
        (4, 8), (16, 8)]
    text = run("host_overhead.py", "--seqs", "4", "--steps", "3", "--num-scheduler-steps", "1",
               "--json", str(out))
    assert "decode steps per engine step" not in text
    assert [r["num_scheduler_steps"] for r in json.loads(out.read_text())] == [1]


@pytest.mark.parametrize("stack", ["1", "0"])
def test_engine_ops(tmp_path, stack):
    """Each operation timed inside a run: prefill and decode tables, and the timed spans add up;
    the CPU plugin's decoder stack as one line, or (switched off) the layers' pieces."""
    from omniinfer_cpu.kernels import build

    if stack == "1" and build.load() is None:
        pytest.skip(f"the decoder stack needs the CPU kernels: {build.unavailable_reason()}")
    out = tmp_path / "o.json"
    text = run("engine_ops.py", "--shape", "tiny", "--repeats", "2", "--num-scheduler-steps", "2",
               "--num-prompts", "3", "--output-len", "6", "--json", str(out),
               OMNIINFER_CPU_DECODER_STACK=stack)
    assert "prefill:" in text and "decode:" in text and "lm_head" in text
    assert "3 x (16 in, 6 out)" in text  # the tiny workload's input length, the rest as given
    result = json.loads(out.read_text())
    assert result["num_scheduler_steps"] == 2 and len(result["runs"]) == 2
    assert (result["num_prompts"], result["input_len"], result["output_len"]) == (3, 16, 6)
    decode = result["runs"][0]["decode"]
    assert result["runs"][0]["steps"]["decode"] == 5  # 6 tokens: the prefill samples the first
    # (the argmax of an all-greedy step may happen inside the LM head's product, untimed)
    pieces = ("decoder stack",) if stack == "1" else ("qkv_proj", "o_proj", "gate_up_proj", "down_proj",
                                                       "attention")
    for name in (*pieces, "lm_head", "rms_norm", "input building", "scheduling", "output processing", "step"):
        assert decode[name][0] > 0, name
    assert ("qkv_proj" in decode) == (stack == "0")
    assert decode["step, the rest"][0] >= 0 and decode["forward"][0] < decode["step"][0]
    assert decode["sampling, the rest"][0] >= 0


def test_cpu_gemm(tmp_path):
    from omniinfer_cpu.kernels import build

    if build.load() is None:
        pytest.skip(f"omni_gemm needs the CPU kernels: {build.unavailable_reason()}")
    out = tmp_path / "g.json"
    text = run("cpu_gemm.py", "--shape", "tiny", "--rows", "3", "70", "--rounds", "1", "--iters", "2",
               "--json", str(out))
    assert "omni_gemm" in text and "gate_up_proj" in text
    rows = json.loads(out.read_text())
    assert [(r["product"], r["rows"]) for r in rows][:3] == [("qkv_proj", 3), ("qkv_proj", 70), ("o_proj", 3)]
    assert len(rows) == 10 and all(r["us"]["omni_gemm"] > 0 and r["us"]["onednn"] > 0 for r in rows)


def test_cpu_stream(tmp_path):
    from omniinfer_cpu.kernels import build

    if build.load() is None:
        pytest.skip(f"omni_qlinear needs the CPU kernels: {build.unavailable_reason()}")
    out = tmp_path / "q.json"
    level = build.load().level.name
    text = run("cpu_stream.py", "--rows", "64", "--cols", "256", "--rounds", "2", "--level", level,
               "--json", str(out))
    assert "of the round's read" in text
    rows = json.loads(out.read_text())
    assert [r["kind"] for r in rows] == ["gguf:Q4_0", "gguf:Q8_0", "gguf:Q4_1", "gguf:Q5_0", "gguf:Q5_1", "gguf:Q4_K",
                                         "gguf:Q5_K", "gguf:Q6_K", "gguf:IQ4_NL", "gguf:IQ4_XS", "gguf:Q2_K",
                                         "gguf:Q3_K", "int8", "bfloat16", "float32"]
    assert all(r["level"] == level and r["gbps"] > 0 and r["read_fraction"] > 0 for r in rows)



def test_cpu_stream_layers(tmp_path):
    """--layers N: the medium model's four products per layer, every layer its own copy, in a
    decode step's order; a kind in blocks of 256 cannot tile 896 columns and says so."""
    from omniinfer_cpu.kernels import build

    if build.load() is None:
        pytest.skip(f"omni_qlinear needs the CPU kernels: {build.unavailable_reason()}")
    out = tmp_path / "l.json"
    text = run("cpu_stream.py", "--layers", "2", "--kind", "gguf:Q4_0", "--kind", "gguf:Q4_K", "--kind", "bfloat16",
               "--rounds", "1", "--json", str(out))
    assert "2 medium layers" in text
    assert "gguf:Q4_K  skipped: in blocks of 256" in text
    rows = {r["kind"]: r for r in json.loads(out.read_text())}
    assert sorted(rows) == ["bfloat16", "gguf:Q4_0"]
    weights = 2 * (1152 * 896 + 896 * 896 + 9728 * 896 + 896 * 4864)  # two layers' weights
    assert rows["gguf:Q4_0"]["mb"] == pytest.approx(weights * 18 / 32 / 1e6)
    assert rows["bfloat16"]["mb"] == pytest.approx(weights * 2 / 1e6)

def test_cpu_paged_attention_kernel_ab(tmp_path):
    """Two sources timed side by side (here the same kernel twice: the csrc directory, every file
    built, and its attention.c alone), each checked against torch."""
    out = tmp_path / "k.json"
    source = os.path.join(ROOT, "plugins", "cpu", "omniinfer_cpu", "kernels", "csrc")
    text = run("cpu_paged_attention.py", "--cache", "l3", "--rounds", "1", "--iters", "1",
               "--source", source, "--source", os.path.join(source, "attention.c"), "--json", str(out))
    assert "decode" in text and "csrc:" in text and "attention.c:" in text
    rows = json.loads(out.read_text())
    assert [(r["dtype"], r["kind"]) for r in rows] == [
        ("float32", "decode"), ("float32", "prefill"), ("bfloat16", "decode"), ("bfloat16", "prefill")]
    assert all(len(r["us_per_layer_step"]) == 2 for r in rows)


@pytest.mark.slow
def test_spec_decode(tmp_path):
    text = run("spec_decode.py", "--k", "2", "--batch", "1", "--max-tokens", "8", "--repeats", "1")
    assert "upper bound" in text


def test_the_same_suite_behind_omniinfer_bench():
    env = dict(os.environ, OMNIINFER_LOG_LEVEL="WARNING")
    omniinfer = os.path.join(os.path.dirname(sys.executable), "omniinfer")
    proc = subprocess.run([omniinfer, "bench", "throughput", "--shape", "tiny", "--repeats", "2",
                           "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["shape"] == "tiny" and result["omniinfer"]["mfu"] > 0  # the --compare path: above
    assert len(result["omniinfer"]["runs_s"]) == 2


def test_take_turns_rotates_the_order():
    from omniinfer.benchmarks.perf import take_turns

    order = []
    runs = {name: (lambda name=name: order.append(name) or len(order)) for name in "abc"}
    times = take_turns(runs, 4)
    assert order == list("abc" "bca" "cab" "abc")
    assert times == {"a": [1, 6, 8, 10], "b": [2, 4, 9, 11], "c": [3, 5, 7, 12]}


@pytest.mark.parametrize("script", ["throughput.py", "host_overhead.py"])
def test_a_terminated_benchmark_deletes_its_checkpoint(tmp_path, script):
    """SIGTERM (as from `timeout`) unwinds: the temporary checkpoint does not stay on disk."""
    args = {"throughput.py": ["--shape", "tiny", "-n", "64", "--output-len", "512", "--repeats", "50"],
            # one row is over in well under a second (a trivial model), and a SIGTERM that lands as
            # the interpreter exits reads as 0 or -15: forty rows keep it running for tens of seconds
            "host_overhead.py": ["--seqs", *["64"] * 40, "--steps", "480"]}[script]
    env = dict(os.environ, OMNIINFER_LOG_LEVEL="WARNING", TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", script), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("*/*/model.safetensors")):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was built"
            time.sleep(0.05)
        time.sleep(1.0)  # into the run
        assert proc.poll() is None, "the run ended before it could be stopped"
        proc.terminate()
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    # (torch's compile cache may stay: it is meant to)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor")] == []


def test_take_turns_sets_a_skipped_configuration_aside():
    from omniinfer.benchmarks.perf import SkippedRun, take_turns

    calls = []

    def refused():
        calls.append("b")
        raise SkippedRun("not enough memory")

    times = take_turns({"a": lambda: 1.0, "b": refused, "c": SkippedRun("never runs")}, 3)
    assert times["a"] == [1.0, 1.0, 1.0] and calls == ["b"]
    assert str(times["b"]) == "not enough memory" and str(times["c"]) == "never runs"


def test_transformers_refusing_its_cache_skips_that_row(monkeypatch, tmp_path):
    """transformers' continuous batching sizes its cache against the memory free at that moment
    and may raise MemoryError (seen: 5.5 GB asked, 4.6 available): the row says so, the others
    are measured."""
    from transformers import PreTrainedModel

    from omniinfer.benchmarks import perf

    def no_memory(self, *args, **kwargs):
        raise MemoryError("Memory footprint 5485752320 is more than available memory 4566176563")

    monkeypatch.setattr(PreTrainedModel, "generate_batch", no_memory, raising=False)
    result = perf.throughput("tiny", "float32", num_prompts=4, input_len=8, output_len=4,
                             compare="transformers")
    assert result["transformers_continuous"]["skipped"].startswith(
        "transformers refused the KV cache omniinfer gets: Memory footprint")
    assert result["transformers_static"]["output_tokens_per_s"] > 0
    table = perf.throughput_table(result)
    assert "transformers cont.   skipped: transformers refused" in table


def test_a_gguf_throughput_table_says_what_its_mfu_is_against():
    from omniinfer.benchmarks import perf

    run = {"output_tokens_per_s": 250.0, "total_tokens_per_s": 750.0, "requests_per_s": 3.9, "mfu": 1.94}
    result = {"shape": "medium", "num_prompts": 32, "input_len": 128, "output_len": 64, "threads": 2,
              "matmul_peak_gflops": 314.0, "omniinfer": run}
    note = "(MFU: against torch's float32 matmul peak; a GGUF file's products"
    assert note in perf.throughput_table({**result, "dtype": "gguf q4_0"})
    assert note not in perf.throughput_table({**result, "dtype": "float32"})


def test_every_result_names_the_cpu_and_its_isa_level():
    from omniinfer.benchmarks.perf import machine, machine_line

    m = machine()
    assert m["cpu"] and m["usable_cpus"] >= 1 and m["platform"] == "cpu"
    line = machine_line(m)
    assert line.startswith(f"machine: {m['cpu']}") and "cpu kernels " in line


def test_the_gguf_export_is_what_transformers_reads(tmp_path):
    """The weights llama.cpp is compared on: transformers loads the GGUF back (it dequantises) to
    the same logits as the checkpoint (float32: exactly; q8_0: within its rounding)."""
    import torch
    from transformers import AutoModelForCausalLM

    from omniinfer.benchmarks.gguf_export import export
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    ids = torch.tensor([[1, 5, 9, 33, 7, 200]])
    for arch in ("llama", "qwen2"):  # (Llama's q/k rows are permuted for GGML's rotary)
        path = build_tiny_checkpoint(str(tmp_path / arch), arch, vocab_size=1000)
        want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
        for file_type, tol in (("f32", 0.0), ("q8_0", 0.2)):
            gguf = export(path, str(tmp_path / f"{arch}-{file_type}.gguf"), file_type)
            model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(gguf),
                                                         dtype=torch.float32)
            got = model(ids).logits
            assert (got - want).abs().max().item() <= tol, (arch, file_type)


def test_llama_cpp_comparison_without_its_tools_is_a_skipped_row(tmp_path):
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if not os.path.exists(os.path.join(d, "llama-bench")))
    text = run("latency.py", "--shape", "tiny", "--input-len", "8", "--output-len", "4", "--repeats", "1",
               "--compare", "llama.cpp", LLAMA_CPP_BIN=str(tmp_path), PATH=path)
    assert "llama.cpp       skipped: llama-bench not found" in text



def test_a_crashing_llama_cpp_tool_is_a_skipped_row_naming_the_signal(tmp_path):
    """llama.cpp's native build dies of SIGSEGV / SIGILL in its AMX path on some VMs: the row
    says which signal, not a bare negative exit status."""
    from omniinfer.benchmarks import llama_cpp
    from omniinfer.benchmarks.perf import SkippedRun

    tool = tmp_path / "llama-bench"
    tool.write_text("#!/bin/sh\necho 'load time 1 ms' >&2\nkill -SEGV $$\n")
    tool.chmod(0o755)
    with pytest.raises(SkippedRun, match="^llama-bench died of SIGSEGV after: load time 1 ms$"):
        llama_cpp._run([str(tool)])

def test_latency_of_a_gguf_file_reports_its_resident_memory():
    """The model as a Q8_0 file: the weights held are the file's bytes (no float copy), measured
    in a fresh process."""
    text = run("latency.py", "--shape", "tiny", "--input-len", "8", "--output-len", "4", "--repeats", "1",
               "--gguf", "q8_0")
    assert "latency: tiny gguf q8_0" in text
    match = re.search(r"weights held (\d+) MB = ([\d.]+)x the file's", text)
    assert match and float(match.group(2)) <= 1.1, text


def test_throughput_of_a_given_model_is_labelled_by_it(tmp_path):
    from omniinfer.testing.tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint(str(tmp_path / "my-model"), "llama")
    text = run("throughput.py", "--model", path, "-n", "4", "--input-len", "8", "--output-len", "4",
               "--num-scheduler-steps", "1")
    assert "throughput: my-model float32" in text and "small" not in text.split("\n")[0], text


def test_throughput_of_a_gguf_file():
    text = run("throughput.py", "--shape", "tiny", "-n", "4", "--input-len", "8", "--output-len", "4",
               "--gguf", "q4_0")
    assert "gguf q4_0" in text and "out tok/s" in text, text


def test_structured_mask_cost_and_grammar_engines(tmp_path):
    pytest.importorskip("xgrammar")
    out = tmp_path / "s.json"
    text = run("structured_mask.py", "--batch", "4", "--output-len", "8", "--repeats", "1",
               "--json", str(out), OMP_NUM_THREADS="1")
    assert "% of a decode step" in text
    result = json.loads(out.read_text())
    assert result["plain_step_ms"] > 0 and result["critical_path_ms"] > 0
    text = run("grammar_engines.py", "--batch", "2", "--steps", "3")
    assert "xgrammar: vocabulary" in text and "us per row" in text


def test_moe_decode_reports_bytes_read_against_active_bytes():
    out = run("moe_decode.py", "--shape", "tiny", "--output-len", "3", "--repeats", "1")
    assert "active parameters' bytes a token" in out
    assert "compiled (omni_moe)" in out and "torch reference (torch reference)" in out
    assert out.count("= 1.000x the active bytes") == 2  # batch 1: top-k distinct experts a layer


def test_quant_moe_times_the_loop_and_the_one_call():
    out = run("quant_moe.py", "--experts", "8", "--hidden", "256", "--intermediate", "256", "--top-k", "2",
              "--tokens", "1", "5", "--repeats", "1")
    assert "8 experts, 256 wide" in out and out.count(" ms, one call ") == 2


def test_cpu_quant_tiles_times_both_paths_where_the_cpu_has_amx():
    out = run("cpu_quant_tiles.py", "--kinds", "Q4_K", "int8", "--shape", "64", "256", "--rows", "4", "40",
              "--repeats", "1")
    assert out.count(" ms (err ") >= 4 and "AMX tiles: " in out
    lines = [line for line in out.splitlines() if " rows  int8 path " in line]
    assert len(lines) == 4
    if "AMX tiles: on" in out:  # (40 rows: the tiles, 4: below their thresholds)
        assert [" tiles " in line for line in lines] == [False, True, False, True], lines
    else:
        assert not any(" tiles " in line for line in lines), lines


def test_collective_waits_times_plain_and_sliced_all_reduces():
    out = run("collective_waits.py", "--numel", "64", "--iters", "5", "--rounds", "2")
    assert out.startswith("machine: ") and "gloo all-reduce of 64 floats" in out
    assert out.count(" median ") == 2 and "sliced / plain: " in out
    out = run("collective_waits.py", "--op", "stage", "--numel", "64", "--iters", "5", "--rounds", "2")
    assert "gloo stage-to-stage round trip (0 -> 1 -> 0) of 64 floats" in out
    assert out.count(" median ") == 2 and "broadcast / send/recv: " in out


def test_quant_moe_decode_steps_route_each_token_anew():
    out = run("quant_moe.py", "--experts", "8", "--hidden", "256", "--intermediate", "256", "--top-k", "2",
              "--decode-steps", "4", "--rounds", "1", "--kinds", "Q4_0", "Q8_0")
    # 2 experts a token: gate/up 512 rows of 256 in Q4_0 (144 B a row), down 256 rows of 256 in Q8_0 (272 B)
    routed = 2 * (512 * 144 + 256 * 272) / 2**20
    assert "decode: 4 tokens x 1 rounds, each routed anew" in out and f"routed weights {routed:.1f} MiB" in out
    assert " ms, one call " not in out


def test_sliding_kv(tmp_path):
    out = tmp_path / "skv.json"
    text = run("sliding_kv.py", "--tokens", "640", "--window", "64", "--layers", "6", "--chunk", "64",
               "--json", str(out))
    assert "sliding layers keep their window" in text and "full attention in every layer" in text
    result = json.loads(out.read_text())
    assert result["sliding"]["window_pool"] and not result["full"]["window_pool"]
    assert result["sliding"]["tokens"] == result["full"]["tokens"] == 639
    # 1 full layer of 6 holds 40 blocks, 5 sliding ones at most 4 + 4 + 1 each: <= (40 + 45) / 240
    assert result["held_ratio"] <= 0.36 and result["last_held_ratio"] < result["held_ratio"]


def test_gguf_tiles_runs_every_kind_of_variant_interpreted(tmp_path):
    """benchmarks/gguf_tiles.py (a GPU's sweep of the GGUF kernel's tiles) on a tiny layer under
    the interpreter: what the layers run (gguf_linear), the GEMV, the dequantised weight and the
    GEMM variants each agree with the reference; a spent budget stops the sweep with a line that says so."""
    out = tmp_path / "tiles.json"
    text = run("gguf_tiles.py", "--tiny", "--type", "Q8_0", "--rows", "17", "1", "--only",
               "current|dequant n64 r4|dequant n32 r8|gemm m64 n64 w4|gemv n64 w2|dot16 n64",
               "--json", str(out), TRITON_INTERPRET="1")
    assert "WRONG" not in text and "stops here" not in text, text
    rows = json.loads(out.read_text())["results"]
    assert [(r["rows"], r["variant"].split()[0]) for r in rows] == [
        (17, "torch"), (17, "gguf_linear"), (17, "gguf_tiles"), (17, "dequant"), (17, "dequant"),
        (17, "gemm"), (1, "torch"), (1, "gguf_linear"), (1, "gguf_tiles"), (1, "gemv"),
        (1, "dot16"), (1, "dequant")]
    assert all(r["ok"] for r in rows), rows
    text = run("gguf_tiles.py", "--tiny", "--type", "Q8_0", "--budget-s", "0", TRITON_INTERPRET="1")
    assert "(budget of 0 s spent: the sweep stops here)" in text


def test_gemv_sass_counts_the_decode_loop_of_a_gemv_compiled_for_an_nvidia_target():
    """benchmarks/gemv_sass.py with no GPU: Triton's own ptxas and nvdisasm compile and
    disassemble the Q4_K GEMV for sm_90, and the loop over K is found and counted."""
    triton = pytest.importorskip("triton")
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        pytest.skip(f"this triton ships no nvdisasm ({nvdisasm})")
    out = run("gemv_sass.py", "--only", "Q4_K m1", TRITON_INTERPRET="0")  # compiled, not interpreted
    rows = [line.split() for line in out.splitlines() if line.startswith("bf16 Q4_K m1")]
    assert len(rows) == 1, out
    loop, per_thread, per_weight, clocks, est_us = (float(v) for v in rows[0][6:11])
    # the one-row Q4_K GEMV (gguf_kgemv.py): 128 outputs x one 256-weight block a pass on 128
    # threads, 256 weights a thread; the loop loads, converts and multiplies them (FFMA among
    # the opcodes), a few instructions a weight
    assert per_thread == 256 and loop > 16 and 2 < per_weight < 100, out
    assert clocks > 0 and est_us > 0, out
    assert "FFMA" in out and "not a measurement" in out


def test_sampler_times_every_setting(tmp_path):
    out = tmp_path / "s.json"
    text = run("sampler.py", "--vocab", "5000", "--rows", "1", "3", "--scale", "3", "--repeats", "1",
               "--json", str(out))
    assert "machine: " in text and "top-p 0.95 set holds" in text
    results = json.loads(out.read_text())[0]["results"]
    assert {(r["setting"], r["rows"]) for r in results} == {
        (s, n) for s in ("greedy", "temperature 1", "top-p 0.95", "top-k 40", "llama.cpp defaults", "Qwen2.5 defaults",
                         "greedy, logprobs 5", "temperature 1, logprobs 1")
        for n in (1, 3)}
    assert all(r["ms"] > 0 for r in results)
