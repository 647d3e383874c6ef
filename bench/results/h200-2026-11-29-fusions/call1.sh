# issue 56, session 11, call 1 (bare machine): patches 0083 (a BF16 product added in place by cuBLAS; the SwiGLU
# backward's BF16 copies) and 0084 (argmax, four columns a load): the build, the 1B models, the GPU tests they name
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=120 LB_KERNEL_K="argmax or swiglu or out_prod" \
  LB_TRAIN_K="in_place or reused or frozen" bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed|kernel tests|Error"
grep -E "^(FAILED|ERROR)|in place by cuBLAS" $OUT/fa56-*.log | cut -c1-200 | head -20
rm -f $OUT/summary-*.log
