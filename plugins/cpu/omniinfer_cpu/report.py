"""What `omniinfer env` says of the CPU plugin: the ISA level loaded, and for each kernel
family whether it runs here and, if not, why (a switch, the level, or no kernels at all)."""

from __future__ import annotations

import os


def _off(env: str) -> bool:
    return os.environ.get(env, "1").strip() == "0"


def kernel_report() -> dict:
    from omniinfer_cpu.decoder_stack import ENV_STACK
    from omniinfer_cpu.kernels import build, isa
    from omniinfer_cpu.linear import ENV_EC, ENV_GEMM, ENV_PACK, ENV_Q8

    try:
        level, why = build.selection()
    except ValueError as e:  # OMNIINFER_CPU_ISA names no level
        level, why = None, str(e)
    kernels = build.load() if level else None
    runnable = " ".join(lv.name for lv in isa.runnable_levels()) or "none"
    report = {"cpu_kernels": f"{level or 'none'} ({why}); this CPU runs: {runnable}"}
    if kernels is not None:
        report["cpu_kernel_library"] = str(kernels.path)
    families = {}

    def family(name: str, active: bool, why: str) -> None:
        families[name] = {"active": active, "why": why}

    if kernels is None:
        for name in ("packed GEMM", "coded weight copies", "int8 LM head", "decoder stack",
                     "paged attention", "layer ops", "mixture of experts", "AMX quantised prefills"):
            family(name, False, f"no compiled kernels: {why}; torch's ops run instead")
        report["cpu_kernel_families"] = families
        return report
    packing = os.environ.get(ENV_PACK, "auto").strip()
    report["cpu_weight_copies"] = {
        "0": f"none ({ENV_PACK}=0): the packed GEMM, coded copies and int8 head are not used",
        "1": f"made at load ({ENV_PACK}=1)"}.get(
        packing, f"made at load when they fit a quarter of the available memory ({ENV_PACK}=0/1 forces)")
    copies = "no weight copies" if packing == "0" else "its copies made at load"
    if _off(ENV_GEMM):
        family("packed GEMM", False, f"{ENV_GEMM}=0: 3+ rows go to oneDNN's packed weights")
    else:
        bf16 = ("bfloat16 pairs by vdpbf16ps" if kernels.gemm_k_multiple(1) == 2
                else "bfloat16 widened to float32 FMAs")
        family("packed GEMM", packing != "0",
               f"omni_gemm for 3+ rows (prefills, batches): float32, {bf16}; {copies}")
    coded = [name for code, name in ((0, "float32"), (1, "bfloat16")) if kernels.ec_supported(code)]
    if _off(ENV_EC):
        family("coded weight copies", False, f"{ENV_EC}=0")
    elif coded:
        family("coded weight copies", packing != "0",
               f"batch-1 decode reads {' and '.join(coded)} weights from 7/8 (float32) or 3/4 "
               f"(bfloat16) of their bytes; {copies}")
    else:
        family("coded weight copies", False,
               f"decoded with AVX-512 VBMI byte permutes (the avx512_vbmi level); {level} reads "
               "the weights as they are")
    family("int8 LM head", not _off(ENV_Q8) and packing != "0",
           f"{ENV_Q8}=0" if _off(ENV_Q8) else
           f"greedy tokens of 1-2 rows from an int8 copy of the head (one TP rank); {copies}")
    family("decoder stack", not _off(ENV_STACK),
           f"{ENV_STACK}=0" if _off(ENV_STACK) else
           "all decoder layers in one omni_decoder_layers call (prefills need the packed GEMM)")
    family("paged attention", True, "CPU_PAGED: omni_paged_attention (prefill, chunked, decode)")
    family("layer ops", True, "RMS norm, rotary, SiLU-and-multiply, greedy argmax")
    from omniinfer_cpu.moe import MAX_ROWS as MOE_ROWS

    family("mixture of experts", True,
           f"omni_moe for up to {MOE_ROWS} tokens a step: each token reads only its routed experts' "
           "weights (float32, bfloat16); prefills run the torch reference (oneDNN per expert); MoE "
           "layers are not in the decoder stack")
    family("AMX quantised prefills", kernels.amx == "on",
           f"GGUF products of {AMX_ROWS}+ rows and int8 of {AMX_ROWS_I8}+ (prefills, batches) on AMX's bfloat16 tiles "
           "(quant_amx.c: x and weights rounded to "
           f"bfloat16, float32 sums); {build.ENV_AMX}=0 keeps them on the int8 path" if kernels.amx == "on"
           else f"{kernels.amx}: products of many rows stay on the int8 path")
    family("weight prefetch", True,
           f"batch-1 products (quantised, float and coded weights) prefetch the weight 4 KB ahead into "
           f"{kernels.prefetch}; {build.ENV_PREFETCH}=l1|l2 chooses")
    report["cpu_kernel_families"] = families
    return report


AMX_ROWS, AMX_ROWS_I8 = 16, 8  # (quant_blocks.h's AMX_MIN_ROWS, AMX_MIN_ROWS_I8)
