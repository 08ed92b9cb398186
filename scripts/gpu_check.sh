#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA, AMD or Intel GPU, run the attention conformance
# kit for the platform present, the attention-kernel micro-benchmark and the quantized-GEMM
# micro-benchmark (benchmarks/quant_kernels.py: each Triton GEMM/GEMV timed against F.linear on
# the same weights and checked against the torch reference), sweep the GGUF kernel's tiles
# (benchmarks/gguf_tiles.py: which launch configuration, or dequantise-then-F.linear, is fastest
# per type and row count; every variant checked), serve quantized models end to end
# (python -m omniinfer.testing.quant_models: tiny GGUF, GPTQ and AWQ files loaded as a user
# loads them, greedy tokens against transformers), run the Triton kernels' own tests on the GPU
# (the one-row GEMVs' bit-for-bit decodes of every GGUF type, the int8 and n-bit ones: their first
# run on hardware), and compile every catalogued
# Triton kernel configuration ahead of time (python -m omniinfer.testing.kernels_aot:
# sm_80/90/100, gfx90a, gfx942, plus this GPU, loaded by its driver); then print the summary
# table (per backend: conformance passed/failed/skipped, decode/prefill/chunked tokens/s), the
# quantized kernels' times and models, and the kernels' table (registers, spills, shared memory
# per configuration and target), and time the Sampler (benchmarks/sampler.py: each sampling
# setting at 1 and 32 rows, and a 2048-token prompt's log-probs). Time limits: kit 5 min,
# attention benchmark 2.5, quantized benchmark 3.3 (13 formats since 2026-12-08: FP8 too), int8
# weight-only at 64-512 rows both ways 1, tile sweep 4 (it stops itself at 220 s), the Sampler
# 1.5; the kernel compiles, the quantized models and the kernel tests
# run beside the kit, within its 5. On an H200 (2026-12-04) the whole check took 180 s
# with the sweep at rows 1 and 512 (now 1, 2, 4, 8 and 512): well within a 10-minute call.
#
#   scripts/gpu_check.sh                 # uses $PYTHON, else python3 with .gpu-site (below)
#   PYTHON=/opt/venv/bin/python scripts/gpu_check.sh
#   GPU_CHECK_PLATFORM=cpu scripts/gpu_check.sh   # a dry run anywhere (the test suite runs one)
#
# The Python it uses must already hold a GPU build of torch and Triton (the project's .venv
# holds the CPU build). With no $PYTHON it is python3 (or $GPU_CHECK_BASE_PYTHON), which the
# script leaves as it is: omniinfer and its plugins are built without build isolation (python3's
# own setuptools) and installed, with whatever of their requirements python3 lacks, into
# .gpu-site, which goes on PYTHONPATH. Offline, as the lent GPU machines are: the missing
# requirements come from wheels carried in .whl/ (scripts/gpu_wheels.sh fetches them here; see
# docs/conformance.md for the whole device command); torch and Triton are never installed, and
# a requirement with no wheel there is named and left out (the server's, which the check does
# not use). GPU_CHECK_WHEELS names another folder of wheels, GPU_CHECK_REQUIRE more requirements
# (whitespace-separated); GPU_CHECK_SETUP_ONLY=1 stops after the set-up (the test suite runs one,
# offline).
# Results land in ${GPU_CHECK_OUT:-gpu_check_out}/. GPU_CHECK_KIT_ARGS,
# GPU_CHECK_BENCH_ARGS, GPU_CHECK_QBENCH_ARGS, GPU_CHECK_TILES_ARGS, GPU_CHECK_QMODEL_ARGS and
# GPU_CHECK_AOT_ARGS add (whitespace-separated) arguments to the six steps, e.g. to narrow a dry
# run; GPU_CHECK_TEST_K replaces the kernel tests' -k expression. Exit status: 0
# when the kit passed, every benchmark ran (the quantized kernels within tolerance of the
# reference), every quantized model followed transformers, every kernel test passed and every
# kernel configuration compiled without spills or shared-memory overflow, 1 otherwise, 2 when no
# GPU platform is available.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${GPU_CHECK_OUT:-$ROOT/gpu_check_out}
mkdir -p "$OUT"
unset TRITON_INTERPRET  # kernels must compile for the GPU, not run in the interpreter

say() { printf '\n== %s\n' "$*"; }

if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=$(command -v "${GPU_CHECK_BASE_PYTHON:-python3}")
  SITE=${GPU_CHECK_SITE:-$ROOT/.gpu-site}
  WHEELS=${GPU_CHECK_WHEELS:-$ROOT/.whl}
  say "installing omniinfer and its plugins into $SITE for $PYTHON (its torch untouched)"
  rm -rf "$SITE"
  pip=("$PYTHON" -m pip install -q --disable-pip-version-check --no-cache-dir --no-compile
       --no-deps --target "$SITE")
  # (the CPU kernels build at first use, if ever: not into the wheel). setuptools builds in the
  # tree's build/ folders and never empties them: a module deleted since would be installed, so
  # they go before and after.
  rm -rf "$ROOT/build" "$ROOT"/plugins/*/build
  OMNIINFER_CPU_PREBUILD=0 "${pip[@]}" --no-build-isolation --no-index . plugins/cpu plugins/cuda plugins/rocm plugins/xpu
  rm -rf "$ROOT/build" "$ROOT"/plugins/*/build
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  # what the installed distributions require (and the kit's pytest) that $PYTHON lacks, a round
  # at a time, so that a carried wheel's own requirements are looked at too
  for _ in 1 2 3; do
    mapfile -t missing < <("$PYTHON" - "$SITE" "$WHEELS" ${GPU_CHECK_REQUIRE:-} <<'EOF'
import importlib.metadata as md, os, re, sys
from packaging.requirements import Requirement
site, wheels = sys.argv[1:3]
canon = lambda name: re.sub(r"[-_.]+", "-", name).lower()
carried = {canon(f.split("-")[0]) for f in (os.listdir(wheels) if os.path.isdir(wheels) else ())
           if f.endswith(".whl")}
wanted = ["pytest>=8", "pytest-timeout>=2.3", "triton>=3.0", *sys.argv[3:]]
for dist in md.distributions(path=[site]):
    wanted += dist.requires or []
for line in dict.fromkeys(wanted):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        if req.specifier.contains(md.version(req.name), prereleases=True):
            continue
    except md.PackageNotFoundError:
        pass
    verdict = ("gpu" if canon(req.name) in ("torch", "triton") else
               "fetch" if canon(req.name) in carried else "skip")
    print(verdict, str(req).replace(" ", ""))
EOF
)
    fetch=() skip=()
    for line in "${missing[@]}"; do
      case $line in
        gpu\ *) echo "$PYTHON lacks ${line#* }: the check runs on the machine's own GPU build" >&2
                exit 2 ;;
        fetch\ *) fetch+=("${line#* }") ;;
        *) skip+=("${line#* }") ;;
      esac
    done
    (( ${#fetch[@]} )) || break
    echo "installing from $WHEELS: ${fetch[*]}"
    "${pip[@]}" --no-index --find-links "$WHEELS" "${fetch[@]}"
  done
  if (( ${#skip[@]} )); then echo "not installed (no wheel in $WHEELS): ${skip[*]}"; fi
  "$PYTHON" -c 'from omniinfer.platforms.registry import get_registry; print(get_registry().report())'
  if [[ -n ${GPU_CHECK_SETUP_ONLY:-} ]]; then exit 0; fi
fi

say "environment"
"$PYTHON" - <<'EOF'
import importlib.util, torch
print(f"torch {torch.__version__}  cuda {torch.version.cuda}  hip {torch.version.hip}")
if torch.cuda.is_available():
    print("gpu:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
for lib in ("triton", "flash_attn", "vllm_flash_attn", "xformers", "intel_extension_for_pytorch"):
    print(f"{lib:<28}", "installed" if importlib.util.find_spec(lib) else "-")
EOF

# GPU_CHECK_PLATFORM forces a platform (GPU_CHECK_PLATFORM=cpu dry-runs this script anywhere)
PLATFORM=${GPU_CHECK_PLATFORM:-$("$PYTHON" -c \
  'from omniinfer.platforms.registry import select_platform; print(select_platform().name)')}
if [[ $PLATFORM == cpu && -z ${GPU_CHECK_PLATFORM:-} ]]; then
  echo "no GPU platform is available here (the best platform is cpu); see 'omniinfer env'" >&2
  exit 2
fi

read -r -a kit_args <<<"${GPU_CHECK_KIT_ARGS:-}"
read -r -a bench_args <<<"${GPU_CHECK_BENCH_ARGS:-}"
read -r -a qbench_args <<<"${GPU_CHECK_QBENCH_ARGS:-}"
read -r -a qmodel_args <<<"${GPU_CHECK_QMODEL_ARGS:-}"
read -r -a aot_args <<<"${GPU_CHECK_AOT_ARGS:-}"
read -r -a tiles_args <<<"${GPU_CHECK_TILES_ARGS:-}"
[[ $PLATFORM == cpu ]] || aot_args+=(--device)  # the GPU present too, loaded by its driver

status=0
say "kernels compiled ahead of time, in the background (budget 240 s; log: $OUT/aot.log)"
# CPU-bound, so it runs beside the kit; TRITON_INTERPRET is unset above
timeout 240 "$PYTHON" -m omniinfer.testing.kernels_aot --json "$OUT/aot.json" "${aot_args[@]}" \
  >"$OUT/aot.log" 2>&1 &
aot_pid=$!

say "quantized models end to end on $PLATFORM, in the background (budget 280 s; log: $OUT/quant_models.log)"
# tiny models: their GPU work is small beside the kit's; transformers' reference runs on the CPU
timeout 280 "$PYTHON" -m omniinfer.testing.quant_models --platform "$PLATFORM" \
  --json "$OUT/quant_models.json" "${qmodel_args[@]}" >"$OUT/quant_models.log" 2>&1 &
qmodel_pid=$!

test_k=${GPU_CHECK_TEST_K:-one_row or iq4_polynomial or odd_address or decoder_is or w8a8_split or fp8}
test_pid=
if [[ $PLATFORM == xpu ]]; then
  say "Triton kernel tests: not on xpu (the tests put their tensors on cuda, else interpret them)"
else
  say "Triton kernel tests on $PLATFORM, in the background (budget 280 s; log: $OUT/triton_tests.log)"
  # the fused GEMVs' first run on hardware: one-hot rows give the reference's weights bit for bit
  timeout 280 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" -o timeout=120 \
    --junitxml="$OUT/triton_tests.xml" tests/test_triton_gguf_kernels.py \
    tests/test_triton_quant_kernels.py tests/test_triton_dequant_linear.py -k "$test_k" \
    >"$OUT/triton_tests.log" 2>&1 &
  test_pid=$!
fi

say "conformance kit on $PLATFORM (budget 300 s)"
timeout 300 "$PYTHON" -m omniinfer.testing.conformance --platform "$PLATFORM" -q -p no:cacheprovider \
  -o addopts="" -o timeout=240 --junitxml="$OUT/conformance.xml" "${kit_args[@]}" 2>&1 \
  | tee "$OUT/conformance.log" || status=1

# the benchmarks below time launches whose host side a busy CPU slows, so they start once the
# background work is done (an H200 run that swept the GGUF tiles beside the compiles timed the
# same GEMV at 186-255 us that the run before, sweeping after them, timed at 81-102 us)
wait "$aot_pid" || status=1
wait "$qmodel_pid" || status=1
if [[ -n $test_pid ]]; then wait "$test_pid" || status=1; fi

say "attention-kernel micro-benchmark on $PLATFORM (budget 150 s)"
timeout 150 "$PYTHON" benchmarks/attention_kernels.py --platform "$PLATFORM" --json "$OUT/bench.json" \
  "${bench_args[@]}" 2>&1 | tee "$OUT/bench.log" || status=1

say "quantized-GEMM micro-benchmark on $PLATFORM (budget 200 s)"
timeout 200 "$PYTHON" benchmarks/quant_kernels.py --platform "$PLATFORM" \
  --json "$OUT/quant_bench.json" "${qbench_args[@]}" 2>&1 | tee "$OUT/quant_bench.log" || status=1

say "int8 weight-only around its bound on $PLATFORM (budget 60 s; what INT8_FUSED_MAX_M should be)"
int8_args=()
[[ $PLATFORM != cpu ]] || int8_args=(--include-interpreted --iters 1)
for path in fused dequant; do
  timeout 30 "$PYTHON" benchmarks/quant_kernels.py --platform "$PLATFORM" --format int8-w8a16 \
    --rows 64 --rows 128 --rows 256 --rows 512 --path "$path" --json "$OUT/int8_$path.json" "${int8_args[@]}" \
    2>&1 | tee "$OUT/int8_$path.log" || status=1
done

say "GGUF kernel tiles on $PLATFORM (budget 240 s; what gguf_tiles and GGUF_FUSED_MAX_M should pick)"
# every variant's output is checked (WRONG fails the check); the sweep stops itself at its budget
tiles_env=()
[[ $PLATFORM != cpu ]] || { tiles_args=(--tiny "${tiles_args[@]}"); tiles_env=(TRITON_INTERPRET=1); }
timeout 240 env "${tiles_env[@]}" "$PYTHON" benchmarks/gguf_tiles.py --budget-s 220 --rows 1 2 4 8 512 \
  --json "$OUT/gguf_tiles.json" "${tiles_args[@]}" >"$OUT/gguf_tiles.log" 2>&1 || status=1
# (the whole table is in the log: here the best variant per layer, type and rows, and mishaps)
grep -E "best:|WRONG|FAILED|stops here|Error" "$OUT/gguf_tiles.log" || true

say "the Sampler on $PLATFORM (budget 90 s; what its host syncs and prompt log-probs' chunks cost there)"
sampler_args=()
[[ $PLATFORM != cpu ]] || sampler_args=(--vocab 5000 --repeats 1)
timeout 60 "$PYTHON" benchmarks/sampler.py --platform "$PLATFORM" --json "$OUT/sampler.json" \
  "${sampler_args[@]}" 2>&1 | tee "$OUT/sampler.log" || status=1
timeout 30 "$PYTHON" benchmarks/sampler.py --platform "$PLATFORM" --prompt-logprobs 2048 --repeats 3 \
  --json "$OUT/sampler_prompt.json" "${sampler_args[@]}" 2>&1 | tee -a "$OUT/sampler.log" || status=1

say "summary ($PLATFORM)"
"$PYTHON" - "$OUT/conformance.xml" "$OUT/bench.json" "$OUT/quant_bench.json" \
  "$OUT/quant_models.json" "$OUT/triton_tests.xml" <<'EOF'
import collections, json, os, re, sys
import xml.etree.ElementTree as ET

def outcome(case):
    return ("failed" if case.find("failure") is not None or case.find("error") is not None
            else "skipped" if case.find("skipped") is not None else "passed")


counts = collections.defaultdict(lambda: collections.Counter())
if os.path.exists(sys.argv[1]):
    for case in ET.parse(sys.argv[1]).iter("testcase"):
        m = re.search(r"\[([A-Z0-9_]+)", case.get("name", ""))
        backend = m.group(1) if m else "(kit)"
        counts[backend][outcome(case)] += 1
bench = {}
if os.path.exists(sys.argv[2]):
    with open(sys.argv[2]) as f:
        bench = {r["backend"]: r for r in json.load(f)["results"]}
fmt = lambda v: f"{v:,.0f}" if isinstance(v, (int, float)) else "-"
print(f"{'backend':<12} {'passed':>6} {'failed':>6} {'skipped':>7}  {'dtype':<9} "
      f"{'decode tok/s':>13} {'prefill tok/s':>14} {'chunked tok/s':>14}")
for name in sorted(set(counts) | set(bench)):
    c, b = counts[name], bench.get(name, {})
    print(f"{name:<12} {c['passed']:>6} {c['failed']:>6} {c['skipped']:>7}  {b.get('dtype', '-'):<9} "
          f"{fmt(b.get('decode')):>13} {fmt(b.get('prefill')):>14} {fmt(b.get('chunked')):>14}")
if os.path.exists(sys.argv[3]):
    with open(sys.argv[3]) as f:
        quant = json.load(f)["results"]
    print(f"\nquantized GEMMs{'':<33} {'rows':>5} {'torch us':>9} {'triton us':>10} {'error':>8}")
    for r in quant:
        name = f"{r['layer']} {r['format']} {r['dtype']}"
        state = (f"{r['triton_us']:>10.1f} {r['error']:>8.1e}{'' if r['ok'] else ' FAIL'}"
                 if "triton_us" in r else "FAILED" if "failed" in r else "skipped")
        print(f"{name:<48} {r['rows']:>5} {r['torch_us']:>9.1f} {state}")
if os.path.exists(sys.argv[4]):
    with open(sys.argv[4]) as f:
        models = json.load(f)
    print(f"\nquantized models (against transformers) {'agreed':>8} {'ms/tok':>7}  kernels")
    for r in models:
        state = (f"{r['agreed']:>8} {r['ms_per_token']:>7.1f}  {', '.join(r['kernels'])}" if r["ok"]
                 else f"FAILED: {r['failed']}")
        print(f"{r['case']:<39} {state}")
if os.path.exists(sys.argv[5]):
    cases = list(ET.parse(sys.argv[5]).iter("testcase"))
    tests = collections.Counter(outcome(case) for case in cases)
    failed = [case.get("name") for case in cases if outcome(case) == "failed"]
    print(f"\nTriton kernel tests: {tests['passed']} passed, {tests['failed']} failed, "
          f"{tests['skipped']} skipped" + "".join(f"\n  FAILED {name}" for name in failed))
EOF
echo
cat "$OUT/aot.log"
say "result: $([[ $status == 0 ]] && echo PASS || echo FAIL) (logs in $OUT)"
exit $status
