#!/usr/bin/env bash
# CUDA smoke run for the device tool (an H200 with CUDA 13, Python 3.12, nanobind, scikit-build-core,
# numpy, pytest; no network). The caller carries .device/: llama.cpp.tar.xz (the patched vendor tree,
# trimmed to what the build and tests use) and whl/ (ml_dtypes, hypothesis, gguf and their deps).
# Builds llamabind with CUDA for sm_90, then runs the ops tests (CPU) and the GPU-vs-CPU tests.
# Logs and a summary go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/llamabind-out}
mkdir -p "$OUT"
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
source "$(dirname "$0")/setup.sh"
python3 -m llamabind info
python3 -c "from llamabind import ops; print(ops.devices())"
t0=$SECONDS
python3 -m pytest tests/test_ops_backends.py tests/test_patches.py tests/test_ops.py tests/test_ops_grad.py -q \
  -p no:cacheprovider -rs 2>&1 | tail -40
echo "tests in $((SECONDS - t0)) s"
} 2>&1 | tee "$OUT/summary.log"
