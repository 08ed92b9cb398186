"""The ahead-of-time kernel check: every catalogued Triton launch compiled for sm_80, sm_90,
sm_100, gfx90a and gfx942 on this CPU (``python -m omniinfer.testing.kernels_aot``, in a
subprocess: this session's kernels are interpreted), its table printed in the test summary; the
check failing on a configuration that overflows or spills; its refusal table reaching the
backends' ``validate()``."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from omniinfer.attention.backend import AttentionSpec
from omniinfer.attention.backends.triton import TritonBackend
from omniinfer.kernels.triton import catalogue as cat
from omniinfer.kernels.triton import refusals
from omniinfer.kernels.triton.refusals import KnownFailure
from omniinfer.testing.kernels_aot import Result, assess
from omniinfer.testing.kernels_aot.compile import Compiled, parse_amdgcn, parse_ptxas

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
FIXTURE = "tests/fixtures/aot_oversized.py:catalogue"


def run_check(out_dir: Path, *args: str, timeout: int = 300):
    """(the finished process, its JSON report)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    path = out_dir / "aot.json"
    proc = subprocess.run([sys.executable, "-m", "omniinfer.testing.kernels_aot", "--json",
                           str(path), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return proc, json.loads(path.read_text()) if path.exists() else None


class _Summary:
    """Prints the check's table in pytest's terminal summary (with or without -s)."""

    def __init__(self, text: str):
        self.text = text

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.section("Triton kernels compiled ahead of time (tests/test_kernels_aot.py)")
        terminalreporter.write_line(self.text.rstrip())


@pytest.fixture(scope="module")
def full_run(request, tmp_path_factory):
    proc, report = run_check(tmp_path_factory.mktemp("aot"))
    request.config.pluginmanager.register(_Summary(proc.stdout + proc.stderr[-3000:]))
    return proc, report


# ---- the whole catalogue -------------------------------------------------------------------------
def test_every_catalogued_configuration_compiles_for_every_target(full_run):
    proc, report = full_run
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    compiled = {t["name"] for t in report["targets"]}
    expected = {t.name for t in cat.TARGETS if t.name not in report["skipped_targets"]}
    assert compiled == expected and {"sm_80", "sm_90", "gfx90a", "gfx942"} <= compiled
    assert not (set(report["skipped_targets"]) - {t.name for t in cat.TARGETS if t.optional})
    pairs = {(r["op"], r["config"], r["target"]) for r in report["results"]}
    assert pairs == {(launch.op, launch.config, t) for launch in cat.catalogue() for t in compiled}
    for r in report["results"]:
        assert r["registers"] > 0 and r["shared_bytes"] is not None, r
        assert r["problems"] == [] or r["refused"], r  # the refused ones fail where listed
    assert report["failures"] == [] and report["complete"]


def _jit_kernels() -> set[str]:
    """module.function of every @triton.jit kernel in the core and the plugins (the check's own
    probe in testing/ aside): a jit function that no jit function calls (those that are called,
    quant_gemm.accumulate say, are device functions compiled into their callers)."""
    jitted, called = {}, set()
    roots = [(ROOT / "core", ROOT / "core" / "omniinfer")] + [
        (p.parent, p) for p in (ROOT / "plugins").glob("*/omniinfer_*")]
    for base, package in roots:
        for path in package.rglob("*.py"):
            if "testing" in path.relative_to(base).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and any(
                        ast.unparse(d.func if isinstance(d, ast.Call) else d).endswith("jit")
                        for d in node.decorator_list):
                    module = ".".join(path.relative_to(base).with_suffix("").parts)
                    jitted[f"{module}.{node.name}"] = node.name
                    called |= {c.func.id if isinstance(c.func, ast.Name) else c.func.attr
                               for c in ast.walk(node) if isinstance(c, ast.Call)
                               and isinstance(c.func, (ast.Name, ast.Attribute))}
    return {full for full, name in jitted.items() if name not in called}


def test_every_triton_kernel_in_the_project_is_catalogued(full_run):
    _, report = full_run
    kernels = _jit_kernels()
    assert {"omniinfer.kernels.triton.paged_attention._paged_attention_kernel",
            "omniinfer.kernels.triton.reshape_and_cache._reshape_and_cache_kernel"} <= kernels
    missing = kernels - {r["kernel"] for r in report["results"]}
    assert not missing, (f"no catalogued launch compiles {sorted(missing)}: add its launch "
                         "configurations to omniinfer/kernels/triton/catalogue.py")


def test_float32_prefill_runs_the_tile_that_does_not_spill(full_run):
    _, report = full_run
    fp32 = [r for r in report["results"]
            if r["op"] == "paged_prefill_attention" and r["config"].startswith("fp32 32/8x128")]
    assert {r["details"]["num_warps"] for r in fp32} == {8}
    assert {r["details"]["constexprs"]["BLOCK_Q"] for r in fp32} == {8}  # 32 rows of 4 heads


# ---- the check can fail ----------------------------------------------------------------------------
def test_the_check_fails_naming_an_oversized_or_spilling_configuration(tmp_path):
    proc, report = run_check(tmp_path, "--catalogue", FIXTURE, "--op", "dot", "--op", "scale",
                             "--target", "sm_90", "--target", "gfx942", "--jobs", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    by = {(r["config"], r["target"]): r for r in report["results"]}
    assert by[("fp16 16x64x16 (fits)", "sm_90")]["problems"] == []
    assert by[("fp16 16x64x16 (fits)", "gfx942")]["problems"] == []
    for target, limit in (("sm_90", 232448), ("gfx942", 65536)):
        assert (f"bytes of shared memory, {target} allows {limit}"
                in " ".join(by[("fp16 16x4096x16 (shared memory)", target)]["problems"]))
    assert by[("fp32 x8192 1 warp (registers)", "sm_90")]["problems"][0].startswith("spills ")
    failures = "\n".join(report["failures"])
    assert "dot fp16 16x4096x16 (shared memory) [aot_catalogue_aot_oversized._dot_kernel] on sm_90" in failures
    assert "scale fp32 x8192 1 warp (registers)" in failures
    assert "FAILED: dot fp16 16x4096x16 (shared memory)" in proc.stdout
    assert proc.stdout.rstrip().endswith("result: FAIL (3 failure(s))")


FAKE_GPU = """
import json, sys
from types import SimpleNamespace
from triton.backends.compiler import GPUTarget
from triton.compiler import CompiledKernel
from triton.runtime import driver
from omniinfer.testing.kernels_aot import run_check
from omniinfer.testing.kernels_aot.report import table

driver.set_active(SimpleNamespace(  # an H100 as triton's driver would describe it
    get_current_target=lambda: GPUTarget("cuda", 90, 32), get_current_device=lambda: 0,
    utils=SimpleNamespace(get_device_properties=lambda device: {"max_shared_mem": 232448})))

def load(self):  # what the driver reports after cuModuleLoadData
    self.n_regs, self.n_spills = 77, 0

CompiledKernel._init_handles = load
report = run_check(ops=["reshape_and_cache"], targets=["sm_90"], device=True)
print(table(report))
print(json.dumps([(r.target.name, r.target.is_device, r.compiled.registers) for r in report.results]))
"""


def test_with_a_gpu_the_device_gets_its_own_column_from_its_driver():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", FAKE_GPU], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.splitlines()[-1])
    assert len(rows) == 2 * len([c for c in cat.catalogue() if c.op == "reshape_and_cache"])
    assert {tuple(r) for r in rows if r[1]} == {("sm_90", True, 77)}
    assert "sm_90 GPU <=227K" in proc.stdout and "result: PASS" in proc.stdout


def _result(op="square", config="fp32 big", target="gfx942", shape=None, **compiled):
    launch = cat.KernelLaunch(op, config, shape, lambda: None)
    return Result(launch, "k", next(t for t in cat.TARGETS if t.name == target),
                  Compiled(**{"registers": 40, "spill_bytes": 0, "shared_bytes": 1024, **compiled}))


def test_a_listed_failure_is_a_refusal_and_a_stale_entry_fails():
    big = dict(shared_bytes=70000)  # > gfx942's 64 KiB, < sm_90's 227 KiB
    entry = KnownFailure("square", ("gfx942",), lambda shape: True, "needs 68 KiB of LDS")
    results = [_result(**big), _result(target="sm_90", **big)]
    assert assess(results, (entry,)) == []
    assert results[0].refused_by is entry and results[1].problems == []
    # nothing listed: the failure names the configuration and the target
    [failure] = assess([_result(**big)], ())
    assert failure.startswith("square fp32 big [k] on gfx942: needs 70000 bytes of shared memory")
    # the kernel got fixed: the entry is stale
    [stale] = assess([_result()], (entry,))
    assert "no longer fails for fp32 big: remove or narrow the entry" in stale
    assert "matches no catalogued configuration" in assess([], (entry,))[0]
    assert assess([], (entry,), complete=False) == []  # a filtered run cannot tell
    # a compile error and a spill are failures too
    assert "does not compile: CompilationError: x" in assess([_result(error="CompilationError: x")], ())[0]
    assert "spills 96 bytes" in assess([_result(spill_bytes=96)], ())[0]


def test_resource_reports_are_parsed():
    log = ("ptxas info    : Function properties for k\n    16 bytes stack frame, 8 bytes spill "
           "stores, 12 bytes spill loads\nptxas info    : Used 96 registers, used 1 barriers\n")
    assert parse_ptxas(log) == dict(registers=96, stack_bytes=16, spill_bytes=8,
                                    spill_load_bytes=12)
    asm = ("; TotalNumVgprs: 130\n; ScratchSize: 0\n; Occupancy: 3\n  - .agpr_count:     2\n"
           "    .sgpr_count:     80\n    .sgpr_spill_count: 0\n    .vgpr_count:     128\n"
           "    .vgpr_spill_count: 0\n")
    assert parse_amdgcn(asm) == dict(vgprs=128, agprs=2, sgprs=80, vgpr_spills=0, sgpr_spills=0,
                                     spill_bytes=0, occupancy=3, registers=130)


# ---- what backends do with the table ---------------------------------------------------------------
def test_a_device_runs_the_code_of_its_catalogued_target():
    assert cat.target_for_arch("sm_90").name == "sm_90"
    assert cat.target_for_arch("sm_86").name == "sm_80"  # same major: the same code
    assert cat.target_for_arch("sm_103").name == "sm_100"
    assert cat.target_for_arch("sm_75") is None and cat.target_for_arch("sm_120") is None
    assert cat.target_for_arch("gfx942").name == "gfx942"
    assert cat.target_for_arch("gfx1100") is None and cat.target_for_arch(None) is None


def spec(arch, dtype=torch.float32, head_size=256, platform="cuda"):
    return AttentionSpec(device_type="cuda", platform_name=platform, dtype=dtype,
                         head_size=head_size, num_heads=16, num_kv_heads=2, block_size=16,
                         device_arch=arch)


def test_listed_configurations_are_refused_on_their_targets(monkeypatch):
    monkeypatch.setattr("omniinfer.kernels.triton.unavailable_reasons", lambda device_type: [])
    monkeypatch.setattr(refusals, "KNOWN_FAILURES", (KnownFailure(
        "paged_prefill_attention", ("sm_80", "gfx90a"),
        lambda s: s.dtype != torch.float16 and s.head_size > 128, "spills 96 bytes (ptxas)"),))
    reason = "paged_prefill_attention cannot run this configuration on sm_80: spills 96 bytes (ptxas)"
    assert TritonBackend.validate(spec("sm_86")) == [reason]
    assert TritonBackend.validate(spec("sm_90")) == []  # another target
    assert TritonBackend.validate(spec("sm_80", dtype=torch.float16)) == []  # another config
    assert TritonBackend.validate(spec(None)) == []  # no architecture known: nothing to say
    from omniinfer_cuda.attention.xformers import XFormersBackend
    from omniinfer_rocm.attention import rocm_flash

    # XFORMERS never runs the Triton prefill kernel
    assert not [r for r in XFormersBackend.validate(spec("sm_80")) if "paged_prefill" in r]
    # ROCM_FLASH runs it only without CK flash attention
    monkeypatch.setattr(rocm_flash, "load_ck_varlen", lambda: None)
    amd = spec("gfx90a", dtype=torch.bfloat16, platform="rocm")
    assert rocm_flash.RocmFlashBackend.validate(amd) == [
        "paged_prefill_attention cannot run this configuration on gfx90a: spills 96 bytes (ptxas)"]
    monkeypatch.setattr(rocm_flash, "load_ck_varlen", lambda: object())
    assert rocm_flash.RocmFlashBackend.validate(amd) == []


def test_platforms_name_the_architecture_their_device_compiles_for(monkeypatch):
    from omniinfer_cuda.platform import CudaPlatform
    from omniinfer_rocm.platform import RocmPlatform

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=0: (8, 6))
    assert CudaPlatform.device_arch() == "sm_86"
    assert CudaPlatform.attention_spec(dtype=torch.float16, head_size=128, num_heads=8,
                                       num_kv_heads=2, block_size=16).device_arch == "sm_86"
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=0: SimpleNamespace(gcnArchName="gfx90a:sramecc+:xnack-"))
    assert RocmPlatform.device_arch() == "gfx90a"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert CudaPlatform.device_arch() is None and RocmPlatform.device_arch() is None


def test_every_refusal_names_a_catalogued_op_and_target():
    ops = {launch.op for launch in cat.catalogue()}
    for entry in refusals.KNOWN_FAILURES:
        assert entry.op in ops and set(entry.targets) <= {t.name for t in cat.TARGETS}, entry
