# issue 56, 2026-12-02, call 5 (bare machine): the committed tree (the review commit's test helper) built again, the
# GPU tests of patches 0089-0091 and the cross-entropy kernel tests on CUDA0
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/../../.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=100 LB_KERNEL_K="cross_entropy" \
  LB_TRAIN_K="label_classes or bf16_copy_the_products or swiglu_backward_four" timeout 540 bash tests/device/cuda_run.sh fa56 2>&1 \
  | grep -E "build rc|passed|failed|kernel tests|Error"
grep -E "^(FAILED|ERROR)|^E  " $OUT/fa56-*.log | cut -c1-250 | head -20
rm -f $OUT/summary-*.log $OUT/build.log
