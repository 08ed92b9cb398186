#!/usr/bin/env bash
# Fetch, here, the wheels that scripts/gpu_check.sh installs on a GPU machine that cannot reach
# an index (the lent H200s: Python 3.12, x86-64, an image with CUDA's torch and Triton but not
# every requirement of omniinfer's). They land in .whl/ (git ignores it), which the device
# command carries; gpu_check.sh installs from there only what that machine's python3 lacks.
#
#   scripts/gpu_wheels.sh            # gguf: what the check needs and the H200 image lacks
#   scripts/gpu_wheels.sh gguf fastapi uvicorn   # more (with --no-deps: name their needs too)
#
# PYTHON_VERSION (default 3.12) picks the wheels' Python. Mind the size: the working tree and
# .whl/ travel together, 64 MiB at most.
set -euo pipefail
cd "$(dirname "$0")/.."
names=("$@")
(( ${#names[@]} )) || names=(gguf)
mkdir -p .whl
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d .whl "${names[@]}"
ls -l .whl
du -sh .whl
