"""scripts/gpu_check.sh dry-run on the CPU (GPU_CHECK_PLATFORM=cpu), narrowed to one backend, one
quantized GEMM (interpreted), one GGUF tile variant, one quantized model and one kernel op: the
one command to run on a GPU machine works end to end before a GPU appears (environment, kernels
compiled ahead of time, conformance kit, benchmarks, the tables, exit status; $PYTHON is this
interpreter). Its offline set-up (the machine's python3, packages from carried wheels, no
index) runs on its own (GPU_CHECK_SETUP_ONLY=1)."""

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
               GPU_CHECK_TILES_ARGS="--type Q8_0 --rows 1 --only gguf_linear",
               GPU_CHECK_AOT_ARGS="--op reshape_and_cache --target sm_90 --target gfx942 --jobs 1",
               GPU_CHECK_TEST_K="iq4_polynomial")
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
    # int8 weight-only around its bound, both ways (what INT8_FUSED_MAX_M should be)
    for path in ("fused", "dequant"):
        rows = json.loads((tmp_path / f"int8_{path}.json").read_text())["results"]
        assert [(r["format"], r["rows"], r["ok"]) for r in rows] == [("int8-w8a16", m, True) for m in (64, 128, 256, 512)]
    # a quantized model, loaded as a user loads it, followed transformers
    [model] = json.loads((tmp_path / "quant_models.json").read_text())
    assert model["case"] == "gguf-q4_k_m" and model["ok"] and model["platform"] == "cpu"
    assert "quantized models (against transformers)" in summary and "gguf-q4_k_m" in summary
    assert "quantized GEMMs" in summary
    # the Triton kernels' own tests ran (interpreted here; compiled on a GPU)
    assert "Triton kernel tests: 1 passed, 0 failed, 0 skipped" in summary
    # the kernels' table, next to the backends'
    assert "Triton kernels compiled ahead of time" in summary and "result: PASS" in summary
    report = json.loads((tmp_path / "aot.json").read_text())
    assert {r["target"] for r in report["results"]} == {"sm_90", "gfx942"}
    assert {r["op"] for r in report["results"]} == {"reshape_and_cache"} and not report["failures"]
    # the GGUF tile sweep ran (interpreted, on a tiny layer) and named its best variant
    assert "tiny                Q8_0     1  best: gguf_linear (current)" in out
    tiles = json.loads((tmp_path / "gguf_tiles.json").read_text())["results"]
    assert [r["variant"].split()[0] for r in tiles] == ["torch", "gguf_linear"] and tiles[1]["ok"]
    # the Sampler timed on the platform's device (here the CPU's memory, a small vocabulary)
    [sampling] = json.loads((tmp_path / "sampler.json").read_text())
    assert sampling["device"] == "cpu" and sampling["vocab"] == 5000 and len(sampling["results"]) == 32
    assert all(r["ms"] > 0 for r in sampling["results"])
    [prompt] = json.loads((tmp_path / "sampler_prompt.json").read_text())
    assert prompt["prompt_logprobs"]["rows"] == 2048 and prompt["prompt_logprobs"]["ms"] > 0
    assert "the Sampler on a 5000-token vocabulary (cpu)" in out
    for name in ("conformance.xml", "conformance.log", "bench.json", "bench.log", "aot.log",
                 "quant_bench.log", "gguf_tiles.log", "triton_tests.log", "triton_tests.xml", "sampler.log"):
        assert (tmp_path / name).exists(), name


def _wheel(folder: Path, name: str, version: str) -> None:
    """A pure-Python wheel of one empty module, written by hand (the format: PEP 427)."""
    import base64
    import hashlib
    import zipfile

    module, info = name.replace("-", "_"), f"{name.replace('-', '_')}-{version}.dist-info"
    files = {f"{module}/__init__.py": "",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()] + [f"{info}/RECORD,,"]
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in {**files, f"{info}/RECORD": "\n".join(record) + "\n"}.items():
            whl.writestr(path, text)


def test_gpu_check_sets_up_offline_from_carried_wheels(tmp_path):
    """The set-up a lent GPU machine runs (no $PYTHON: the machine's python3, no index): omniinfer
    and its plugins built with that Python's setuptools into a folder of their own, a missing
    requirement installed from the carried wheels, one with no wheel named, the plugins found."""
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "omniinfer-probe", "1.2")
    env = dict(os.environ, GPU_CHECK_BASE_PYTHON=sys.executable, GPU_CHECK_SITE=str(site),
               GPU_CHECK_WHEELS=str(wheels), GPU_CHECK_REQUIRE="omniinfer-probe>=1 omniinfer-absent>=2",
               GPU_CHECK_SETUP_ONLY="1", GPU_CHECK_OUT=str(tmp_path / "out"), PIP_NO_INDEX="1")
    env.pop("PYTHON", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert f"installing from {wheels}: omniinfer-probe>=1" in out
    assert f"not installed (no wheel in {wheels}): omniinfer-absent>=2" in out
    assert "cpu: available" in out and "failed to load" not in out
    assert {p.name.split("-")[0] for p in site.glob("*.dist-info")} == {
        "omniinfer", "omniinfer_cpu", "omniinfer_cuda", "omniinfer_rocm", "omniinfer_xpu", "omniinfer_probe"}
    where = subprocess.run([sys.executable, "-c", "import omniinfer, omniinfer_probe; print(omniinfer.__file__)"],
                           env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True, text=True, check=True)
    assert where.stdout.startswith(str(site))
