"""The CPU kernels: one library per ISA level (isa.py), the best the CPU runs, through ctypes.

Where a level's library comes from, first found:

1. the package's own ``lib/``: a wheel of omniinfer-cpu carries every level of its architecture,
   built by ``setup.py`` when the wheel is built (``lib/manifest.json`` names them and the
   source they were built from), so an installed plugin compiles nothing;
2. the per-user cache (``$OMNIINFER_CPU_KERNEL_CACHE``, else ``~/.cache/omniinfer/cpu_kernels``),
   keyed by the source, the compiler and the level's flags: a source checkout builds a level at
   its first use with the system C compiler (``$CC``, else gcc, else cc; 5-25 s, logged) and
   loads it in milliseconds after. ``python -m omniinfer_cpu.kernels.build`` builds every level
   this CPU runs ahead of time.

The libraries need no torch headers. Their OpenMP calls bind to the libgomp torch has already
loaded (same soname), so the kernels and torch's own ops share one thread pool.

The level loaded is the best this CPU runs (cpuinfo flags), or the best at or below
``OMNIINFER_CPU_ISA`` (a cap: also how one machine tests every level it can run). A library
reports the level it was built for (``omni_isa``), checked at load. When the kernels cannot be
used (``OMNIINFER_CPU_KERNELS=0`` or ``OMNIINFER_CPU_ISA=none``, a CPU below the lowest level,
no compiler, a failed build) :func:`load` returns None and :func:`unavailable_reason` says why;
callers fall back to torch.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

from omniinfer.logger import init_logger
from omniinfer_cpu.kernels import isa

logger = init_logger(__name__)

ENV_SWITCH = "OMNIINFER_CPU_KERNELS"  # "0" turns the compiled kernels off
ENV_CACHE = "OMNIINFER_CPU_KERNEL_CACHE"  # where libraries built at first use go
ENV_AMX = "OMNIINFER_CPU_AMX"  # "0" keeps prefills off AMX's tiles (quant_amx.c)
ENV_PREFETCH = "OMNIINFER_CPU_PREFETCH"  # "l2" / "l1": where batch-1 products prefetch (prefetch.h)
# the CPU vendors whose batch-1 streams measured faster prefetched into L2 (prefetch.h), by name
L2_VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD"}
AMX_STATES = {1: "on", 0: f"off ({ENV_AMX}=0)", -1: "this level's library has no AMX code (avx512_bf16's has)",
              -2: "the CPU or the OS cannot run AMX-BF16 tiles"}
CSRC = Path(__file__).parent / "csrc"  # one C file per kernel family, omni.h shared
PREBUILT = Path(__file__).parent / "lib"  # where setup.py puts a wheel's libraries
MANIFEST = "manifest.json"

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "omni_isa": ([], ctypes.c_char_p),
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
    # rotary_dim, dtype, nthreads
    "omni_rotary": ([_P, _I64, _P, _I64, _P, _P, _P, _I32, _I32, _I32, _I32, _I32, _I32, _I32, _I32], _I32),
    # x, out, T, I, dtype, nthreads
    "omni_silu_and_mul": ([_P, _P, _I32, _I32, _I32, _I32], None),
    # x, ld, rows, cols, dtype, out (int64), nthreads
    "omni_argmax": ([_P, _I64, _I32, _I32, _I32, _P, _I32], None),
    # dtype
    "omni_gemm_supported": ([_I32], _I32),
    # dtype
    "omni_gemm_k_multiple": ([_I32], _I32),
    # N, K, gated
    "omni_gemm_packed_size": ([_I32, _I32, _I32], _I64),
    # w, N, K, gated, dtype, out, nthreads
    "omni_gemm_pack": ([_P, _I32, _I32, _I32, _I32, _P, _I32], None),
    # x, ldx, packed, bias, y, ldy, M, N, K, gated, dtype, nthreads
    "omni_gemm": ([_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32, _I32], _I32),
    # x, ldx, packed, bias, out (int64), M, N, K, dtype, nthreads
    "omni_gemm_argmax": ([_P, _I64, _P, _P, _P, _I32, _I32, _I32, _I32, _I32], _I32),
    # kind (quant_blocks.h: 0 Q8_0, 1 Q4_0, 2 Q4_K, 3 Q6_K, 4 int8, 9-12 Q4_1 Q5_0 Q5_1 Q5_K; 5-8
    # and 13-16 those in groups of 8 rows, 17-19 IQ4_NL IQ4_XS Q2_K in groups of 8; + 64: int8 activations)
    "omni_quant_supported": ([_I32], _I32),
    # x, ldx, w (blocks, or int8 q), scale (int8's, else NULL), y, ldy, M, N, K, kind, dtype, nthreads
    "omni_qlinear": ([_P, _I64, _P, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32, _I32], _I32),
    # on (1: the AMX tiles for prefills where the CPU has them, quant_amx.c; 0: off) -> 1 on, 0 off,
    # -1 no AMX code at this level (either way), -2 the CPU or the OS cannot run it
    "omni_amx_enable": ([_I32], _I32),
    # on (1: batch-1 products prefetch the weight into L2 only, prefetcht1; 0: every level) -> on
    "omni_prefetch_to_l2": ([_I32], _I32),
    # w (blocks, or int8 q), scale (int8's, else NULL), kind, N, K, ids (int64 [n]), n, out [n, K],
    # dtype, nthreads
    "omni_qrows": ([_P, _P, _I32, _I32, _I32, _P, _I32, _P, _I32, _I32], _I32),
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
    # x (float32 [H]), w13, s13 (int64 [E]: each expert's blocks and scale, 0: none), kind13 (int32
    # [E]), w2, s2, kind2, ids (int64 [n]), weights (float32 [n]), n, E, out (float32 [H]), H, I,
    # nthreads
    "omni_qmoe": ([_P, _P, _P, _P, _P, _P, _P, _P, _P, _I32, _I32, _P, _I32, _I32, _I32], _I32),
    # x (float32 [T, H]), T, w13 (int64 [E] addresses), kind13, w2, kind2, ids (int64 [T, n]),
    # weights (float32 [T, n]), n, E, out (float32 [T, H]), H, I, nthreads
    "omni_qmoe_tokens": ([_P, _I32, _P, _I32, _P, _I32, _P, _P, _I32, _I32, _P, _I32, _I32, _I32], _I32),
    # x, ldx, w13 [E, 2I, H], w2 [E, H, I], topk_ids (int64 [T, K]), topk_weights (float32 [T, K]),
    # out, ldo, T, K, E, H, I, dtype, nthreads
    "omni_moe": ([_P, _I64, _P, _P, _P, _P, _P, _I64, _I32, _I32, _I32, _I32, _I32, _I32, _I32], _I32),
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


def source_digest() -> str:
    return isa.source_digest(str(CSRC))


def _compiler() -> str:
    for name in filter(None, (os.environ.get("CC"), "gcc", "cc")):
        path = shutil.which(name)
        if path:
            return path
    raise KernelsUnavailable("no C compiler found (set CC, or install gcc); a wheel of "
                             "omniinfer-cpu carries the kernels prebuilt")


def prebuilt_path(level: isa.IsaLevel) -> Path | None:
    """The package's own library for `level`, when it was built from this source."""
    try:
        manifest = json.loads((PREBUILT / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    name = manifest.get("levels", {}).get(level.name)
    if not name or manifest.get("source_sha256") != source_digest():
        return None  # (a checkout whose source changed since its libraries were built)
    path = PREBUILT / name
    return path if path.is_file() else None


def library_path(level: isa.IsaLevel) -> Path:
    """The library for `level`: prebuilt, cached, or built now into the cache."""
    found = prebuilt_path(level)
    if found is not None:
        return found
    cc = _compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = hashlib.sha256()
    for part in (source_digest().encode(), version.encode(), " ".join(isa.BASE_CFLAGS + level.cflags).encode()):
        key.update(part)
        key.update(b"\0")
    target = cache_dir() / f"cpu_kernels-{level.name}-{key.hexdigest()[:16]}.so"
    if not target.is_file():
        logger.info("building the CPU kernels for %s with %s into %s (once; a wheel of omniinfer-cpu "
                    "carries them prebuilt)", level.name, Path(cc).name, target.parent)
        try:
            warning = isa.build_library(cc, level, isa.sources(str(CSRC)), str(target))
        except RuntimeError as e:
            raise KernelsUnavailable(str(e)) from None
        if warning:
            logger.warning("CPU kernels for %s %s", level.name, warning)
    return target


class Kernels:
    """One level's loaded library: its functions with ctypes signatures."""

    def __init__(self, path: Path, level: isa.IsaLevel):
        self.path, self.level = path, level
        self.lib = ctypes.CDLL(str(path))
        for name, (args, result) in SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, result
            setattr(self, name.removeprefix("omni_"), fn)
        built_for = self.isa().decode()
        if built_for != level.name:
            raise KernelsUnavailable(f"{path} was built for {built_for}, not {level.name}")
        self.set_amx(os.environ.get(ENV_AMX, "1").strip().lower() not in ("0", "false", "off", "no"))
        target, why = prefetch_target()
        self.prefetch_to_l2(1 if target == "l2" else 0)
        self.prefetch = f"{target.upper()} ({why})"

    def set_amx(self, on: bool) -> str:
        """Turn quantised prefills' AMX tiles on or off (tests compare the two); says which and why."""
        self.amx = AMX_STATES[self.amx_enable(1 if on else 0)]
        return self.amx

    @property
    def isa_level(self) -> str:
        return self.level.name


def prefetch_target() -> tuple[str, str]:
    """Where the batch-1 products' software prefetch puts the weight ("l2": L2 only, prefetcht1;
    "l1": every level, prefetcht0) and why: $OMNIINFER_CPU_PREFETCH, else L2 on Intel and AMD
    CPUs, where it measured faster (csrc/prefetch.h), and L1 on the others (Arm: not measured)."""
    value = os.environ.get(ENV_PREFETCH, "").strip().lower()
    if value:
        if value not in ("l1", "l2"):
            raise ValueError(f"{ENV_PREFETCH}={value!r}: allowed values are l2 (prefetch into L2 "
                             "only) and l1 (into every level)")
        return value, f"{ENV_PREFETCH}={value}"
    from omniinfer.platforms.host import cpu_info

    vendor = cpu_info().get("vendor", "")
    if vendor in L2_VENDORS:
        return "l2", f"the default on {L2_VENDORS[vendor]} CPUs, where it measured faster"
    return "l1", f"the default on {vendor or 'this CPU'}: L2 is measured on Intel and AMD CPUs only"


def load_level(name: str) -> Kernels:
    """The library of level `name`, whatever the cap (tests and A/B benchmarks); raises
    KernelsUnavailable naming the flags the CPU lacks when it cannot run that level."""
    return _load_level(name)


@functools.cache
def _load_level(name: str) -> Kernels:
    level = isa.BY_NAME[name]
    missing = isa.missing_flags(level)
    if missing:
        raise KernelsUnavailable(f"this CPU cannot run the {name} kernels: it lacks {', '.join(missing)}")
    return Kernels(library_path(level), level)


def _switched_off() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no")


@functools.cache
def _load() -> tuple[Kernels | None, str]:
    if _switched_off():
        return None, f"switched off ({ENV_SWITCH}=0)"
    level, why = isa.choose(os.environ.get(isa.ENV_ISA))  # a cap naming no level raises
    if level is None:
        logger.warning("CPU kernels unavailable, using torch's ops instead: %s", why)
        return None, why
    # a level this compiler cannot build (an older gcc without -mavxvnni, say) yields to the
    # best runnable level below it, rather than losing the kernels altogether
    order = [lv.name for lv in isa.arch_levels()]
    below = [lv for lv in isa.runnable_levels() if order.index(lv.name) <= order.index(level.name)]
    failed = []
    for candidate in reversed(below):
        try:
            kernels = load_level(candidate.name)
        except (KernelsUnavailable, OSError, subprocess.SubprocessError) as e:
            failed.append(f"{candidate.name}: {e}")
            continue
        if failed:
            why = f"{'; '.join(failed)}; so {candidate.name}, the best level below it"
            logger.warning("CPU kernels: %s", why)
        logger.info("CPU kernels: %s (%s), from %s", candidate.name, why, kernels.path)
        return kernels, why
    why = "; ".join(failed)
    logger.warning("CPU kernels unavailable, using torch's ops instead: %s", why)
    return None, why


def load() -> Kernels | None:
    """The compiled kernels at the chosen level, or None (see :func:`unavailable_reason`)."""
    return _load()[0]


def unavailable_reason() -> str | None:
    kernels, why = _load()
    return None if kernels is not None else why


def selection() -> tuple[str | None, str]:
    """(the level loaded or None, why): for `omniinfer env` and benchmark reports."""
    kernels, why = _load()
    return (kernels.level.name if kernels is not None else None), why


def reset() -> None:
    """Forget the loaded state (tests switch the kernels on and off)."""
    _load.cache_clear()
    _load_level.cache_clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the CPU kernels ahead of time (into the cache).")
    parser.add_argument("--level", action="append", choices=[lv.name for lv in isa.arch_levels()],
                        help="a level to build (repeatable; default: every level this CPU runs)")
    args = parser.parse_args(argv)
    names = args.level or [lv.name for lv in isa.runnable_levels()]
    for name in names:
        print(f"{name}: {library_path(isa.BY_NAME[name])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
