"""Recording a catalogued launch and compiling it for a target, with no device.

The launch code runs on meta tensors while ``JITFunction.run`` records its arguments instead of
compiling; each recorded launch is then specialised the way triton's launcher specialises it
(its own binder, with the target's backend: dtypes, 16-divisible integers and pointers,
constexprs, options) and compiled by ``triton.compile`` for that target. Registers and spills
come from ptxas' ``-v`` report (NVIDIA) and the amdgcn assembly's metadata (AMD); shared memory
from the compiled kernel's metadata.

Written against triton 3.9's launcher (``create_function_from_signature``,
``JITFunction._pack_args``); triton must be imported without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
from dataclasses import dataclass, field
from typing import Any

from omniinfer.kernels.triton.catalogue import KernelLaunch, Target


@dataclass(frozen=True)
class RecordedLaunch:
    kernel: Any  # the triton JITFunction
    args: tuple
    kwargs: dict


@dataclass
class Compiled:
    """What one kernel compiled to for one target (numbers are None when unknown)."""

    registers: int | None = None
    spill_bytes: int | None = None  # NVIDIA: spill stores; AMD: scratch (private segment)
    shared_bytes: int | None = None
    seconds: float = 0.0
    error: str | None = None  # the compiler's complaint, when it failed
    details: dict = field(default_factory=dict)  # raw counts, constexprs, options


def record(launch: KernelLaunch) -> list[RecordedLaunch]:
    """Run `launch` with triton's launcher replaced by a recorder; the launches it made."""
    from triton.runtime.jit import JITFunction

    calls: list[RecordedLaunch] = []

    def run(self, *args, grid, warmup, **kwargs):
        calls.append(RecordedLaunch(self, args, kwargs))

    original = JITFunction.run
    JITFunction.run = run
    try:
        launch.launch()
    finally:
        JITFunction.run = original
    return calls


def specialise(call: RecordedLaunch, target: Target):
    """(options, signature, constexprs, attrs) as triton's launcher derives them for `target`."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget(target.backend, target.arch, target.warp_size))
    kwargs = dict(call.kwargs, debug=call.kernel.debug or knobs.runtime.debug)
    binder = create_function_from_signature(call.kernel.signature, call.kernel.params, backend)
    bound, specialization, options = binder(*call.args, **kwargs)
    return call.kernel._pack_args(backend, kwargs, bound, specialization, options)


def compile_for(call: RecordedLaunch, target: Target) -> Compiled:
    """Compile one recorded launch for `target` and read its resource use (for the device
    present, `target.is_device`, also load it and take the driver's register count)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    start = time.perf_counter()
    log = io.StringIO()
    try:
        options, signature, constexprs, attrs = specialise(call, target)
        source = ASTSource(call.kernel, signature, constexprs, attrs)
        with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report is printed, not kept
            kernel = triton.compile(source, target=GPUTarget(target.backend, target.arch,
                                                             target.warp_size),
                                    options=options.__dict__)
        if target.is_device:
            kernel._init_handles()  # raises OutOfResources where the device cannot hold it
    except Exception as e:  # the compiler's own error is the finding
        message = str(e).strip().splitlines()
        return Compiled(seconds=time.perf_counter() - start,
                        error=f"{type(e).__name__}: {message[0] if message else ''}"[:300])
    seconds = time.perf_counter() - start
    named = {call.kernel.arg_names[path[0]]: value for path, value in constexprs.items()}
    details = dict(constexprs={k: v for k, v in named.items()
                               if isinstance(v, (bool, int, float, str))},
                   num_warps=kernel.metadata.num_warps, num_stages=kernel.metadata.num_stages)
    if target.backend == "cuda":
        counts = parse_ptxas(log.getvalue())
    else:
        counts = parse_amdgcn(kernel.asm["amdgcn"])
    if target.is_device:  # what the driver says of the loaded kernel
        counts.update(registers=kernel.n_regs, driver_local_bytes=kernel.n_spills)
    details.update(counts)
    return Compiled(registers=counts.get("registers"), spill_bytes=counts.get("spill_bytes"),
                    shared_bytes=int(kernel.metadata.shared), seconds=seconds, details=details)


def parse_ptxas(log: str) -> dict:
    """Registers and spills from `ptxas -v` (also `ptxas-blackwell`)."""
    counts = {}
    if m := re.search(r"Used (\d+) registers", log):
        counts["registers"] = int(m.group(1))
    if m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      log):
        counts.update(stack_bytes=int(m.group(1)), spill_bytes=int(m.group(2)),
                      spill_load_bytes=int(m.group(3)))
    return counts


def parse_amdgcn(asm: str) -> dict:
    """VGPRs (+AGPRs), SGPRs, spills and scratch from the amdgcn assembly's kernel metadata."""
    def number(pattern: str) -> int | None:
        m = re.search(pattern, asm, re.MULTILINE)
        return int(m.group(1)) if m else None

    counts = dict(vgprs=number(r"^[\s-]*\.vgpr_count:\s+(\d+)"),
                  agprs=number(r"^[\s-]*\.agpr_count:\s+(\d+)"),
                  sgprs=number(r"^[\s-]*\.sgpr_count:\s+(\d+)"),
                  vgpr_spills=number(r"^[\s-]*\.vgpr_spill_count:\s+(\d+)"),
                  sgpr_spills=number(r"^[\s-]*\.sgpr_spill_count:\s+(\d+)"),
                  spill_bytes=number(r"^; ScratchSize: (\d+)"),
                  occupancy=number(r"^; Occupancy: (\d+)"))
    counts["registers"] = number(r"^; TotalNumVgprs: (\d+)")
    if counts["registers"] is None and counts["vgprs"] is not None:
        counts["registers"] = counts["vgprs"] + (counts["agprs"] or 0)
    return {k: v for k, v in counts.items() if v is not None}


# ---- the worker side (one process compiles tasks one at a time) --------------------------------
_WORKER: dict = {}


def init_worker(extra: list[str]) -> None:
    """Load the catalogue in this process and make triton compile every time (so ptxas reports)."""
    import warnings

    from triton import knobs

    from omniinfer.testing.kernels_aot import load_launches

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    knobs.compilation.always_compile = True
    _WORKER.update(launches=load_launches(extra)[0], recorded={})


def compile_task(task: tuple[int, int, Target]) -> tuple[str, Compiled]:
    """(launch index, recorded call index, target) -> (kernel name, what it compiled to)."""
    index, call_index, target = task
    recorded = _WORKER["recorded"]
    if index not in recorded:
        recorded[index] = record(_WORKER["launches"][index])
    call = recorded[index][call_index]
    name = f"{call.kernel.fn.__module__}.{call.kernel.fn.__name__}"
    return name, compile_for(call, target)


def device_target() -> Target:
    """The GPU present as a target, with its driver's shared-memory limit."""
    from triton.runtime import driver

    from omniinfer.kernels.triton.catalogue import target_for_arch

    active = driver.active
    gpu = active.get_current_target()
    props = active.utils.get_device_properties(active.get_current_device())
    arch = f"sm_{gpu.arch}" if gpu.backend == "cuda" else str(gpu.arch)
    known = target_for_arch(arch)
    return Target(arch, gpu.backend, gpu.arch, gpu.warp_size,
                  known.platform if known else gpu.backend, int(props["max_shared_mem"]),
                  known.max_registers if known else 255, "this GPU", is_device=True)


def probe_task(target: Target) -> str | None:
    """Why the installed triton cannot compile for `target` (None: it can)."""
    from omniinfer.testing.kernels_aot import probe

    return compile_for(record(probe.LAUNCH)[0], target).error
