# issue 56, 2026-12-02, call 2 (bare machine): patches 0090 (cross-entropy labels as classes) and 0091 (the
# cross-entropy backward writes the gradient's BF16 copy) in the build: the cross-entropy kernel tests on CUDA0 (the
# class form against the CPU), the training tests of both (carry .device-s), then the 2048 x 4 rows with PyTorch bf16
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/../../.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=100 LB_KERNEL_K="cross_entropy" \
  LB_TRAIN_K="label_classes or bf16_copy_the_products" timeout 420 bash tests/device/cuda_run.sh fa56 2>&1 \
  | grep -E "build rc|passed|failed|kernel tests|Error"
grep -E "^(FAILED|ERROR)|^E  " $OUT/fa56-*.log | cut -c1-250 | head -20
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_SETTINGS="LLAMA_OPT_LABEL_CLASSES=1" \
  timeout 165 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
rm -f $OUT/summary-*.log $OUT/bench-train-raw.log
