# issue 56, 2026-12-01, call 3 (bare machine): patches 0088 (dK/dV 32 keys a warp) and 0089 (the SwiGLU backward four
# elements a thread) in the build: the flash and SwiGLU kernel tests on CUDA0 (the 128-key kernel by default and the
# 64-key one, the new default-and-agreement test), the training tests of 0089 and 0087 (the last session's review
# commit, not yet run on a GPU), the norm fusions' training test at its new 1e-3 tolerance (not yet rerun)
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/../../.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=200 LB_KERNEL_K="flash or swiglu or trained_rms_norm or rms_norm_back_of_a_weighted" \
  LB_TRAIN_K="swiglu_backward or adamw_four or norm_back" timeout 560 bash tests/device/cuda_run.sh fa56 2>&1 \
  | grep -E "build rc|passed|failed|kernel tests|Error"
grep -E "^(FAILED|ERROR)|^E  " $OUT/fa56-*.log | cut -c1-250 | head -20
grep -E "NMSE|^\{" $OUT/fa56-train-tests.log | cut -c1-300 | head -12
rm -f $OUT/summary-*.log
