"""What the decode GEMVs cost per weight in NVIDIA instructions, with no GPU: each weight-only
GEMV launch of the kernel catalogue (kernels/triton/catalogue.py: every GGUF block type, the
n-bit layers and int8 W8A16 at one row) compiled for an NVIDIA target by the installed Triton
(its own ptxas), disassembled by its own nvdisasm, and the loop that runs over K (the hottest:
the longest loop closed by a backward branch) counted per weight a thread decodes in one pass.

    python benchmarks/gemv_sass.py [--target sm_90] [--only REGEX] [--sms 132 --ghz 1.98]

The estimate is issue-bound, not a measurement: each instruction of the loop weighted by its
class's rate in SM lanes a clock from the CUDA C++ Programming Guide's arithmetic-instruction
table for compute capability 9.0 (float32 add/multiply/FMA 128; conversions 16; shuffles and
memory instructions 32; the rest, integer and logic, 64), summed per weight, then scaled to the
layer's weights on `--sms` SMs at `--ghz`. Uniform-datapath instructions (one per warp) are not
counted. Against the H200's timings of 2026-12-04 (docs/quantization.md) the estimate of that
revision was 0.7-1.3x the measured time. Use it to compare revisions of a kernel, then time them
on a GPU (scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import warnings

# SM lanes a clock per instruction class on compute capability 9.0 (CUDA C++ Programming Guide,
# "Arithmetic Instructions"); anything not named runs at the integer rate, 64
RATE = dict(FFMA=128, FMUL=128, FADD=128, HADD2=128, HFMA2=128, HMUL2=128, FSEL=64,
            I2F=16, F2F=16, I2I=16, F2I=16, MUFU=16, SHFL=32,
            LDG=32, LDS=32, STS=32, STG=32, LDL=32, STL=32, ATOM=32, RED=32)


def hot_loop(sass: str) -> list[str]:
    """The instructions of the longest loop (a label up to a branch back to it)."""
    lines = sass.splitlines()
    code, labels = {}, {}
    for i, line in enumerate(lines):
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = i
        elif m := re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", line):
            code[i] = m.group(1)
    best: list[str] = []
    for i, text in code.items():
        target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), i) < i:
            body = [code[j] for j in range(labels[target.group(1)], i + 1) if j in code]
            best = max(best, body, key=len)
    return best


def opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def compile_sass(call, target) -> tuple[str, dict, int]:
    """(SASS, constexprs, threads a program) of one recorded launch compiled for `target`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from omniinfer.testing.kernels_aot.compile import specialise

    options, signature, constexprs, attrs = specialise(call, target)
    kernel = triton.compile(ASTSource(call.kernel, signature, constexprs, attrs),
                            target=GPUTarget(target.backend, target.arch, target.warp_size),
                            options=options.__dict__)
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    named = {call.kernel.arg_names[path[0]]: value for path, value in constexprs.items()}
    return sass, named, target.warp_size * kernel.metadata.num_warps


def unrolled(named: dict) -> int:
    """K tiles one pass of the hot loop covers: the GGUF kernel's one-row GEMVs take UNROLL
    classic blocks (gguf_gemv.py) or one 256-weight Q2_K-Q6_K block (gguf_kgemv.py) a pass; every
    other launch one tile."""
    one_row = named.get("ONE_ROW")
    if isinstance(one_row, bool):  # the int8 kernel's flag: BLOCK_K inputs a pass either way
        return 1
    if one_row == 1:
        return named["UNROLL"]
    if one_row in (2, 3, 4, 5, 6):
        return 256 // named["BLOCK_K"]
    return 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="sm_90", help="an NVIDIA target of the catalogue")
    parser.add_argument("--only", default="", help="a regex the launch's label must match")
    parser.add_argument("--sms", type=int, default=132, help="SMs of the GPU the estimate is for (H100 SXM/H200: 132)")
    parser.add_argument("--ghz", type=float, default=1.98, help="its clock (boost)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    from omniinfer.kernels.triton.catalogue import TARGETS, gguf_launches, quant_launches
    from omniinfer.testing.kernels_aot.compile import record

    target = next((t for t in TARGETS if t.name == args.target and t.backend == "cuda"), None)
    if target is None:
        print(f"--target {args.target!r}: not an NVIDIA target of the catalogue "
              f"({', '.join(t.name for t in TARGETS if t.backend == 'cuda')})", file=sys.stderr)
        return 2
    launches = [launch for launch in (*gguf_launches(), *quant_launches())
                if launch.op in ("gguf_gemv", "wn_gemv", "int8_matmul") and launch.shape.m == 1
                and re.search(args.only, launch.name)]
    print(f"decode GEMVs on {target.name} ({target.example}), issue-bound estimate on {args.sms} SMs at "
          f"{args.ghz} GHz (not a measurement)")
    print(f"{'layer':50s} {'loop':>5s} {'w/thread':>8s} {'instr/w':>7s} {'clk/w':>6s} {'est us':>7s}  most frequent")
    for launch in launches:
        for call in record(launch):
            sass, named, threads = compile_sass(call, target)
            if "BLOCK_N" not in named or (launch.op == "int8_matmul" and not named.get("ONE_ROW")):
                continue  # (an activation quantization; W8A8's tl.dot tiles)
            loop = hot_loop(sass)
            ops = collections.Counter(opcode(i) for i in loop if not opcode(i).startswith("U"))
            # weights a thread decodes a pass of the loop (K tiles a pass: `unrolled`)
            per_thread = named["BLOCK_N"] * named["BLOCK_K"] * unrolled(named) / threads
            # SM clocks a weight: a warp's instruction takes 32 / rate clocks of the SM
            clocks = sum(count * 32 / RATE.get(op, 64) for op, count in ops.items()) / (32 * per_thread)
            weights = launch.shape.n * launch.shape.k
            est_us = weights * clocks / args.sms / (args.ghz * 1e3)
            top = " ".join(f"{op} {count}" for op, count in ops.most_common(8))
            print(f"{launch.config:50s} {len(loop):5d} {per_thread:8.0f} {sum(ops.values()) / per_thread:7.1f} "
                  f"{clocks:6.3f} {est_us:7.1f}  {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
