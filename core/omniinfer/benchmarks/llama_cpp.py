"""llama.cpp on the benchmarks' own weights (`--compare llama.cpp`): optional, never in CI.

The checkpoint is written as GGUF (gguf_export.py) in the benchmark's dtype, and llama.cpp's own
tools time it: `llama-bench` for batch-1 (prompt processing of the input, then decode after a
context of the input's length, as `-p I -n 0` and `-p 0 -n O -d I`), `llama-batched-bench` for
N parallel sequences (`-npl N -npp I -ntg O`). The tools are found in `--llama-cpp-bin DIR`,
`$LLAMA_CPP_BIN` or on PATH; where they are not, the comparison is a skipped row saying so.
Each run is one invocation (`-r 1`), so the rounds interleave with the other engines'.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

ENV_BIN = "LLAMA_CPP_BIN"
FILE_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def tool(name: str, directory: str | None = None) -> str:
    from omniinfer.benchmarks.perf import SkippedRun

    for d in filter(None, (directory, os.environ.get(ENV_BIN))):
        path = os.path.join(d, name)
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found:
        return found
    raise SkippedRun(f"{name} not found (give --llama-cpp-bin DIR, set ${ENV_BIN}, or put it on PATH)")


def gguf_of(checkpoint: str, dtype: str, out_dir: str) -> str:
    from omniinfer.benchmarks.gguf_export import export

    file_type = FILE_TYPES[dtype]
    return export(checkpoint, os.path.join(out_dir, f"model-{file_type}.gguf"), file_type)


def _run(cmd: list[str]) -> str:
    from omniinfer.benchmarks.perf import SkippedRun

    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode < 0:  # a crash says which signal (a native build's AMX path on some VMs: SIGSEGV, SIGILL)
        try:
            name = signal.Signals(-out.returncode).name
        except ValueError:
            name = f"signal {-out.returncode}"
        last = (out.stderr.strip().splitlines() or [""])[-1]
        raise SkippedRun(f"{os.path.basename(cmd[0])} died of {name}" + (f" after: {last}" if last else ""))
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
        raise SkippedRun(f"{os.path.basename(cmd[0])} failed: {last}")
    return out.stdout


def latency_run(bench: str, gguf: str, input_len: int, output_len: int, threads: int):
    """A run returns (seconds to process the prompt, seconds per decoded token after it)."""

    def one(args: list[str]) -> dict:
        (row,) = json.loads(_run([bench, "-m", gguf, "-t", str(threads), "-r", "1", "-o", "json", *args]))
        return row

    def run() -> tuple[float, float]:
        prompt = one(["-p", str(input_len), "-n", "0"])
        decode = one(["-p", "0", "-n", str(output_len), "-d", str(input_len)])
        return prompt["avg_ns"] / 1e9, decode["avg_ns"] / 1e9 / output_len

    return run


def throughput_run(batched: str, gguf: str, num_seqs: int, input_len: int, output_len: int, threads: int):
    """A run returns the seconds llama-batched-bench took for the whole workload (prompts and
    decodes of num_seqs sequences at once)."""
    ctx = num_seqs * (input_len + output_len) + 64

    def run() -> float:
        text = _run([batched, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(input_len),
                     "-ntg", str(output_len), "-npl", str(num_seqs), "-t", str(threads),
                     "--output-format", "jsonl"])
        rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        return rows[-1]["t"]

    return run
