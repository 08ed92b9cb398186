"""`omniinfer env`: the report users paste into bug reports."""

from __future__ import annotations

import os
import sys

from omniinfer.platforms.host import cpu_info, memory_info
from omniinfer.version import PLUGIN_API_VERSION, __version__


def collect() -> dict:
    import torch

    from omniinfer.attention.selector import select_attention_backend
    from omniinfer.platforms.registry import PluginError, get_registry

    report = {
        "omniinfer": __version__,
        "plugin_api": PLUGIN_API_VERSION,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_builds": {},
        "plugins": [],
        "platforms": {},
        "selected_platform": None,
        "selected_attention_backend": None,
        "attention_backends": [],
        "models": {},
        "model_conflicts": [],
        "cpu": cpu_info(),
        "memory": memory_info(),
        "environment": {k: v for k, v in os.environ.items() if k.startswith("OMNIINFER_")},
    }
    try:
        registry = get_registry()
    except PluginError as e:  # e.g. OMNIINFER_PLUGINS names a plugin that is not installed
        report["plugin_error"] = str(e)
        return report
    verdicts = registry.availability()
    report["attention_backends"] = sorted(registry.backends)
    report["models"] = {name: {"class": e.target, "provider": e.provider, "overrides": e.overrides,
                               "ignored": e.ignored, "decoder_stack": _stack_note(e.target)}
                        for name, e in sorted(registry.models.items())}
    report["model_conflicts"] = list(registry.model_conflicts)
    from omniinfer.checkpoint_config import TEXT_PARTS

    report["text_parts"] = {arch: text for arch, (text, _) in TEXT_PARTS.items()}
    for r in registry.records:
        report["plugins"].append({"name": r.name, "distribution": r.distribution, "version": r.version,
                                  "loaded": r.is_loaded, "error": r.error or None,
                                  "platforms": r.platform_names, "attention_backends": r.backend_names,
                                  "models": r.model_names})
    for name, cls in sorted(registry.platforms.items()):
        try:
            build = cls.build_info()
        except Exception as e:  # a report must never fail on one plugin
            build = f"unknown ({type(e).__name__}: {e})"
        if build:
            report["torch_builds"][name] = build
        entry = {"available": verdicts[name].is_available, "reason": verdicts[name].reason,
                 "priority": cls.priority, "device_type": cls.device_type,
                 "attention_backend_preferences": list(cls.attention_backend_preferences)}
        if verdicts[name]:
            entry["devices"] = cls.device_names()
        report["platforms"][name] = entry
    try:
        chosen = registry.select_platform(None)
        report["selected_platform"] = chosen.name
        try:
            report["platform_runtime"] = chosen.runtime_info()
        except Exception as e:  # a report must never fail on one plugin
            report["platform_runtime"] = {"error": f"{type(e).__name__}: {e}"}
        report["quantized_formats"] = quantized_formats(chosen, registry.quant_kernels)
        spec = chosen.attention_spec(
            dtype=torch.bfloat16 if chosen.device_type != "cpu" else torch.float32,
            head_size=128, num_heads=32, num_kv_heads=8, block_size=16)
        backend = select_attention_backend(chosen, spec, registry.backends)
        report["selected_attention_backend"] = (f"{backend.name} (for {str(spec.dtype)[6:]}, head "
                                                f"size {spec.head_size})")
    except Exception as e:
        report["selection_error"] = str(e)
    return report


def _stack_note(target: str) -> str:
    """Whether a one-call decoder stack (the CPU plugin's) can run an architecture's layers."""
    import importlib

    module, _, name = target.partition(":")
    try:
        refusal = getattr(importlib.import_module(module), name).decoder_stack_refusal
    except Exception:  # (a plugin's class that cannot be imported here, or has no such method)
        return "unknown"
    why = refusal()
    return "yes (without tensor parallelism; its layers' windows alike)" if why is None else f"no: {why}"


def quantized_formats(platform, kernels: list) -> dict:
    """Each quantised format: the kernel the platform runs it with, or the reference and why."""
    from omniinfer.quantization import gguf_blocks
    from omniinfer.quantization.base import kernel_for
    from omniinfer.quantization.gguf_transcode import LATTICE_AS

    out = {}
    kinds = [f"gguf:{t}" for t in gguf_blocks.QUANTIZED] + ["int8"]
    # GPTQ / AWQ / compressed-tensors layers as loaded: symmetric or with zero points / act-order
    kinds += ["wint4:g128", "wint4:g128:zp", "wint4:g128:act", "wint8:g128", "w8a8", "w8a8:static"]
    # FP8 checkpoints' layers: a scale per 128 x 128 block, or per row (channel / tensor)
    kinds += ["fp8:b128", "fp8"]
    for kind in kinds:
        try:  # (a shape every block size divides)
            cls, why = kernel_for(kind, (256, 4096), platform.device_type, kernels)
        except Exception as e:  # a kernel's own check failing is reported, not raised
            cls, why = None, f"{type(e).__name__}: {e}"
        rewrite = LATTICE_AS.get(kind.partition(":")[2])
        name = None if cls is None else cls.name + (f" (rewritten at load as {rewrite})" if rewrite else "")
        out[kind] = {"active": cls is not None, "why": name if cls is not None else f"reference: {why}"}
    return out


def format_report(r: dict) -> str:
    lines = [f"omniinfer {r['omniinfer']} (plugin API {r['plugin_api']}), Python {r['python']}",
             f"torch {r['torch']}" + "".join(f"; {k}: {v}" for k, v in r["torch_builds"].items())]
    lines.append("plugins:" + (f" not loaded: {r['plugin_error']}" if r.get("plugin_error") else ""))
    none = [] if r.get("plugin_error") else [{"name": "(none installed)", "loaded": False, "error": None,
                                              "distribution": "", "version": "", "platforms": [],
                                              "attention_backends": []}]
    for p in r["plugins"] or none:
        state = "loaded" if p["loaded"] else f"FAILED: {p['error']}" if p["error"] else ""
        provides = ", ".join(p["platforms"] + p["attention_backends"])
        lines.append(f"  {p['name']:<10} {p['distribution']} {p['version']}  {state}"
                     + (f"  [{provides}]" if provides and p["loaded"] else ""))
    lines.append("platforms:")
    for name, p in r["platforms"].items():
        verdict = "available" if p["available"] else "unavailable"
        devices = f" devices: {', '.join(p['devices'])}" if p.get("devices") else ""
        lines.append(f"  {name:<6} {verdict:<11} priority {p['priority']:<3} {p['reason']}{devices}")
    lines.append(f"selected platform: {r['selected_platform']}")
    lines.append(f"selected attention backend: {r['selected_attention_backend']}")
    for key, value in (r.get("platform_runtime") or {}).items():
        if isinstance(value, dict):
            lines.append(f"{key.replace('_', ' ')}:")
            width = max((len(name) for name in value), default=0)
            for name, entry in value.items():
                state = "active" if entry.get("active") else "inactive"
                lines.append(f"  {name:<{width}}  {state:<8}  {entry.get('why', '')}")
        else:
            lines.append(f"{key.replace('_', ' ')}: {value}")
    if r.get("selection_error"):
        lines.append(f"selection error: {r['selection_error']}")
    if r.get("quantized_formats"):
        lines.append("quantized formats (the kernel that runs each):")
        for kind, entry in r["quantized_formats"].items():
            lines.append(f"  {kind:<15} {entry['why']}")
    lines.append(f"attention backends installed: {', '.join(r['attention_backends'])}")
    lines.append("model architectures (provider):")
    for name, m in r.get("models", {}).items():
        note = f"; overrides {', '.join(m['overrides'])}" if m["overrides"] else ""
        note += (f"; also offered by {', '.join(m['ignored'])} (ignored: not marked override)"
                 if m["ignored"] else "")
        lines.append(f"  {name:<28} {m['provider']}  {m['class']}{note}")
        lines.append(f"  {'':<28} one-call decoder stack: {m.get('decoder_stack', 'unknown')}")
    for conflict in r.get("model_conflicts", []):
        lines.append(f"  conflict: {conflict}")
    for arch, text in r.get("text_parts", {}).items():
        lines.append(f"  {arch:<28} its language model alone, as {text} (no image inputs)")
    cpu = r["cpu"]
    lines.append(f"cpu: {cpu['model'] or cpu['machine']}, {cpu['usable_cpus']}/{cpu['logical_cpus']} "
                 f"usable CPUs, ISA: {' '.join(cpu['isa_flags']) or '-'}")
    mem = r["memory"]
    if mem:
        lines.append(f"memory: {mem.get('memtotal_bytes', 0) / 2**30:.1f} GiB total, "
                     f"{mem.get('memavailable_bytes', 0) / 2**30:.1f} GiB available")
    if r["environment"]:
        lines.append("environment: " + " ".join(f"{k}={v}" for k, v in sorted(r["environment"].items())))
    return "\n".join(lines)
