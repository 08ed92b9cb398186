"""scripts/gpu_check.sh dry-run on the CPU (GPU_CHECK_PLATFORM=cpu), narrowed to one backend, one
quantized GEMM (interpreted), one quantized model and one kernel op: the one command to run on a GPU machine works end to end before a GPU appears
(environment, kernels compiled ahead of time, conformance kit, benchmark, both tables, exit
status). Only the .venv-gpu set-up (which needs a GPU build of torch) is left out: $PYTHON is
this interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_PLATFORM="cpu",
               GPU_CHECK_OUT=str(tmp_path),
               GPU_CHECK_KIT_ARGS="--backend TORCH_SDPA -k test_kv_write",
               GPU_CHECK_BENCH_ARGS="--backend TORCH_SDPA --iters 1",
               GPU_CHECK_QBENCH_ARGS="--include-interpreted --format int4-g128 --rows 1 --iters 1",
               GPU_CHECK_QMODEL_ARGS="--case gguf-q4_k_m",
               GPU_CHECK_AOT_ARGS="--op reshape_and_cache --target sm_90 --target gfx942 --jobs 1")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "== summary (cpu)" in out and out.rstrip().endswith(f"== result: PASS (logs in {tmp_path})")
    summary = out[out.index("== summary (cpu)"):]
    [row] = [line.split() for line in summary.splitlines() if line.startswith("TORCH_SDPA")]
    assert int(row[1]) > 0 and row[2] == "0"  # conformance: passed, none failed
    assert row[4] == "float32" and all(float(v.replace(",", "")) > 0 for v in row[5:8])
    # the quantized GEMM ran (interpreted) and agreed with the reference
    [quant] = json.loads((tmp_path / "quant_bench.json").read_text())["results"]
    assert quant["format"] == "int4-g128" and quant["ok"] and quant["triton_us"] > 0
    # a quantized model, loaded as a user loads it, followed transformers
    [model] = json.loads((tmp_path / "quant_models.json").read_text())
    assert model["case"] == "gguf-q4_k_m" and model["ok"] and model["platform"] == "cpu"
    assert "quantized models (against transformers)" in summary and "gguf-q4_k_m" in summary
    assert "quantized GEMMs" in summary
    # the kernels' table, next to the backends'
    assert "Triton kernels compiled ahead of time" in summary and "result: PASS" in summary
    report = json.loads((tmp_path / "aot.json").read_text())
    assert {r["target"] for r in report["results"]} == {"sm_90", "gfx942"}
    assert {r["op"] for r in report["results"]} == {"reshape_and_cache"} and not report["failures"]
    for name in ("conformance.xml", "conformance.log", "bench.json", "bench.log", "aot.log",
                 "quant_bench.log"):
        assert (tmp_path / name).exists(), name
