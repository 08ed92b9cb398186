"""Facts about the host (CPU model, ISA flags, memory) for reports and the CPU platform."""

from __future__ import annotations

import os
import platform as pyplatform

_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq",
              "avx512vl", "avx512vbmi", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
              "amx_bf16", "amx_int8", "asimd", "sve", "sve2")


def cpu_info() -> dict:
    info = {"machine": pyplatform.machine(), "model": "", "logical_cpus": os.cpu_count(),
            "usable_cpus": usable_cpus(),
            "isa_flags": []}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            text = f.read()
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "Model") and not info["model"]:
                info["model"] = value.strip()
            if key == "vendor_id" and "vendor" not in info:
                info["vendor"] = value.strip()  # (x86: GenuineIntel, AuthenticAMD)
            field = {"cpu family": "cpu_family", "model": "model_number"}.get(key)
            if field and field not in info:
                info[field] = value.strip()  # (x86: which microarchitecture)
            if key in ("flags", "Features") and not info["isa_flags"]:
                flags = set(value.split())
                info["isa_flags"] = [f for f in _ISA_FLAGS if f in flags]
    except OSError:
        pass
    return info


def memory_info() -> dict:
    out = {}
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key.lower() + "_bytes"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def available_memory_bytes(default: int = 8 << 30) -> int:
    return memory_info().get("memavailable_bytes", default)
