# issue 56, session 11, call 3 (bare machine): patches 0083 (now with the MUL, RMS_NORM_BACK, ADD fusion), 0084 and
# 0085 (flash attention backward: dO's BF16 copy and D_i in one pass): the build, then the GPU tests they name
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=200 LB_KERNEL_K="argmax or swiglu or out_prod or rms_norm or flash_attention_gradients or training_forward" \
  LB_TRAIN_K="fusions or reused or frozen" bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed|kernel tests|Error"
grep -E "^(FAILED|ERROR)" $OUT/fa56-*.log | cut -c1-200 | head -20
grep -E "^\{" $OUT/fa56-train-tests.log | cut -c1-300 | head
rm -f $OUT/summary-*.log
