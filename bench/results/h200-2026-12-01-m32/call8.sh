# issue 56, 2026-12-01, call 8 (bare machine): patch 0088 after its review commit (the unmasked-tile scans through
# fab_first_open): the build, the flash kernel tests on CUDA0, then bench/train.py's 2048 x 4 rows (no PyTorch: a check
# that the step's speed is that of call 4, not a comparison)
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/../../.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=200 LB_KERNEL_K="flash" timeout 420 bash tests/device/cuda_run.sh fa56 2>&1 \
  | grep -E "build rc|passed|failed|kernel tests|Error"
grep -E "^(FAILED|ERROR)|^E  " $OUT/fa56-*.log | cut -c1-250 | head -20
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_TORCH_RUNS=none LB_SETTINGS="GGML_CUDA_FA_BACK_M32=1" \
  timeout 120 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
rm -f $OUT/summary-*.log $OUT/bench-train-raw.log
