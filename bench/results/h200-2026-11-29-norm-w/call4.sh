# issue 56, session 12, call 4 (bare machine): patch 0086 on its block-a-row kernel: the build, the GPU tests of
# 0086-0088 (and 0083's norm fusion), then bench/train.py's 2048 x 4 rows (full, LoRA, QLoRA) with the norm fusions
# on and off, and the 4096 x 1 rows, PyTorch bf16 / peft bf16 in the same call each
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=100 LB_KERNEL_K="trained_rms_norm or rms_norm_back_of_a_weighted or rms_norm_times" \
  LB_TRAIN_K="norm_back or casts_of_trained or adamw_four or (product_inputs and model)" timeout 400 bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed|kernel tests|Error"
grep -E "^(FAILED|ERROR)|^E  " $OUT/fa56-*.log | cut -c1-250 | head -20
grep -E "^\{" $OUT/fa56-train-tests.log | cut -c1-400 | head -12
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_FUSE_NORM_BACK=1 GGML_CUDA_FUSE_NORM_BACK=0" \
  timeout 160 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
LB_BENCH=1b:4096:1 LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_FUSE_NORM_BACK=1" \
  timeout 110 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
rm -f $OUT/summary-*.log
