# issue 56, 2026-12-02 (second session), call 1 (bare machine): patches 0092 (the flash-attention training forward
# keeps its BF16 Q, K and V; Q rounded by the kernel; the mask classified once) and 0093 (the cross-entropy keeps
# each row's argmax) in the build; the flash, cross-entropy and argmax kernel tests on CUDA0, the training tests of
# both (carry .device-s)
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/../../.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=160 LB_KERNEL_K="flash or cross_entropy or argmax" \
  LB_TRAIN_K="forward_keeps_what or argmax_of_the_accuracy" timeout 585 bash tests/device/cuda_run.sh fa56 2>&1 \
  | grep -E "build rc|passed|failed|kernel tests|Error|error:"
grep -E "^(FAILED|ERROR)|^E  " $OUT/fa56-*.log | cut -c1-250 | head -20
