"""Compile csrc/cpu_kernels.c at first use and load it through ctypes.

The library is built with the system C compiler (``$CC``, else gcc, else cc) and
``-O3 -march=native -fopenmp`` into a per-user cache directory, keyed by the source, the
compiler and the CPU's ISA flags, so later runs load it in milliseconds. It needs no torch
headers (about a second to build). Its OpenMP calls bind to the libgomp torch has already
loaded (same soname), so the kernels and torch's own ops share one thread pool.

When the kernels cannot be used (switched off with ``OMNIINFER_CPU_KERNELS=0``, not an x86-64
CPU with AVX2/AVX-512, no compiler, a failed build) :func:`load` returns None and
:func:`unavailable_reason` says why; callers fall back to torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from omniinfer.logger import init_logger
from omniinfer.platforms.host import cpu_info

logger = init_logger(__name__)

ENV_SWITCH = "OMNIINFER_CPU_KERNELS"  # "0" turns the compiled kernels off
ENV_CACHE = "OMNIINFER_CPU_KERNEL_CACHE"  # where built libraries go
SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.c"
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11")

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    # x, ldx, w, bias, y, ldy, M, N, K, dtype, nthreads
    "omni_linear": ([_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32], None),
    # q, q_stride, key, key_stride, value, value_stride, slot_mapping, num_tokens, k_cache,
    # v_cache, block_tables, table_stride, query_start_loc, seq_lens, num_seqs, out, out_stride,
    # H, KVH, D, block_size, scale, window, dtype, nthreads
    "omni_paged_attention": ([_P, _I64, _P, _I64, _P, _I64, _P, _I32, _P, _P, _P, _I64, _P, _P,
                              _I32, _P, _I64, _I32, _I32, _I32, _I32, _F, _I32, _I32, _I32],
                             _I32),
    # x, residual, residual_out, weight, out, T, H, eps, dtype, nthreads
    "omni_rms_norm": ([_P, _P, _P, _P, _P, _I32, _I32, _F, _I32, _I32], None),
    # q, q_stride, k, k_stride, positions, cos, sin, max_position, T, heads, kv_heads, head,
    # dtype, nthreads
    "omni_rotary": ([_P, _I64, _P, _I64, _P, _P, _P, _I32, _I32, _I32, _I32, _I32, _I32, _I32], _I32),
    # x, out, T, I, dtype, nthreads
    "omni_silu_and_mul": ([_P, _P, _I32, _I32, _I32, _I32], None),
    # x, ld, rows, cols, dtype, out (int64), nthreads
    "omni_argmax": ([_P, _I64, _I32, _I32, _I32, _P, _I32], None),
    # dtype
    "omni_gemm_supported": ([_I32], _I32),
    # N, K, gated
    "omni_gemm_packed_size": ([_I32, _I32, _I32], _I64),
    # w, N, K, gated, dtype, out, nthreads
    "omni_gemm_pack": ([_P, _I32, _I32, _I32, _I32, _P, _I32], None),
    # x, ldx, packed, bias, y, ldy, M, N, K, gated, dtype, nthreads
    "omni_gemm": ([_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32, _I32], _I32),
    # x, ldx, packed, bias, out (int64), M, N, K, dtype, nthreads
    "omni_gemm_argmax": ([_P, _I64, _P, _P, _P, _I32, _I32, _I32, _I32, _I32], _I32),
    # w, N, K, dtype, q (int8 [N, K]), scale [N], coef [2N], nthreads
    "omni_q8_pack": ([_P, _I32, _I32, _I32, _P, _P, _P, _I32], None),
    # x, ldx, w, q, scale, coef, out (int64), M, N, K, dtype, max_candidates, nthreads
    "omni_linear_argmax_q8": ([_P, _I64, _P, _P, _P, _P, _P, _I32, _I32, _I32, _I32, _I32, _I32], _I32),
    # dtype
    "omni_ec_supported": ([_I32], _I32),
    # N, K, dtype, patches
    "omni_ec_size": ([_I32, _I32, _I32, _I64], _I64),
    # w [N, K], N, K, dtype, nthreads
    "omni_ec_count": ([_P, _I32, _I32, _I32, _I32], _I64),
    # w, N, K, dtype, patches, out, nthreads
    "omni_ec_pack": ([_P, _I32, _I32, _I32, _I64, _P, _I32], _I32),
    # x, ldx, ec, bias, y, ldy, M, N, K, dtype, nthreads
    "omni_linear_ec": ([_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32], _I32),
    # layers (omni_layer[]), num_layers, hidden, residual, has_residual, positions, slot_mapping, T,
    # block_tables, table_stride, query_start_loc, seq_lens, num_seqs, work, kernel_rows, dtype,
    # nthreads
    "omni_decoder_layers": ([_P, _I32, _P, _P, _I32, _P, _P, _I32, _P, _I64, _P, _P, _I32, _P, _I32,
                             _I32, _I32], _I32),
}


class KernelsUnavailable(RuntimeError):
    pass


def cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "omniinfer" / "cpu_kernels"


def _compiler() -> str:
    for name in filter(None, (os.environ.get("CC"), "gcc", "cc")):
        path = shutil.which(name)
        if path:
            return path
    raise KernelsUnavailable("no C compiler found (set CC, or install gcc)")


def _check_isa() -> list[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise KernelsUnavailable(f"built only for x86-64 (this is {platform.machine()})")
    flags = cpu_info()["isa_flags"]
    if "avx512f" not in flags and not {"avx2", "fma"} <= set(flags):
        raise KernelsUnavailable("the CPU has neither AVX-512 nor AVX2+FMA")
    return flags


def _build(cc: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    # with OpenMP first; a compiler without libgomp still gets single-threaded kernels
    for extra in (["-fopenmp"], []):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        cmd = [cc, *flags, *extra, str(SOURCE), "-o", tmp, "-lm"]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode == 0:
            os.replace(tmp, target)  # atomic: concurrent builders race harmlessly
            if not extra:
                logger.warning("CPU kernels built without OpenMP (single-threaded): %s",
                               errors[-1] if errors else "")
            return
        os.unlink(tmp)
        errors.append(result.stderr.strip().splitlines()[-1] if result.stderr.strip() else
                      f"exit status {result.returncode}")
    raise KernelsUnavailable(f"{Path(cc).name} failed to build {SOURCE.name}: {errors[0]}")


def library_path(extra_flags: tuple[str, ...] = ()) -> Path:
    """Build the library if needed; its path. `extra_flags` (tests: another -march) go last."""
    isa = _check_isa()
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), " ".join(flags).encode(), " ".join(isa).encode()):
        key.update(part)
        key.update(b"\0")
    target = cache_dir() / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if not target.is_file():
        logger.info("building the CPU kernels with %s into %s", Path(cc).name, target.parent)
        _build(cc, flags, target)
    return target


class Kernels:
    """The loaded library: its functions with ctypes signatures."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        for name, (args, result) in SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, result
            setattr(self, name.removeprefix("omni_"), fn)


@functools.cache
def _load() -> tuple[Kernels | None, str | None]:
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return None, f"switched off ({ENV_SWITCH}=0)"
    try:
        kernels = Kernels(library_path())
    except (KernelsUnavailable, OSError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels unavailable, using torch's ops instead: %s", e)
        return None, str(e)
    return kernels, None


def load() -> Kernels | None:
    """The compiled kernels, or None (see :func:`unavailable_reason`)."""
    return _load()[0]


def unavailable_reason() -> str | None:
    return _load()[1]


def reset() -> None:
    """Forget the loaded state (tests switch the kernels on and off)."""
    _load.cache_clear()
