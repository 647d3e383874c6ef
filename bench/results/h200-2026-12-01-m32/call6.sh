# issue 56, 2026-12-01, call 6 (right after call 5, warm): the 1B full fine-tune at 16,384 x 1 (no PyTorch)
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/../../.."
LB_BENCH=1b:16384:1 LB_RUNNERS=full LB_TORCH_RUNS=none LB_STEPS=4 LB_SETTINGS="GGML_CUDA_FA_BACK_M32=1" timeout 200 \
  bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done|rror"
rm -f $OUT/summary-*.log $OUT/bench-train-raw.log
