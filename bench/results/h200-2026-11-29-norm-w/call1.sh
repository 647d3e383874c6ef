# issue 56, session 12, call 1 (bare machine): the build; the GPU tests not rerun after session 11's last call (argmax
# (600, 4100); the norm-back fusion's training test at 2e-4); then the full fine-tune's kernel tables at 2048 x 4 and
# 4096 x 1 (the step's breakdown before this session's changes) and LoRA's at 4096 x 1
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=100 LB_KERNEL_K="argmax or rms_norm_back_of_a_weighted" \
  LB_TRAIN_K="fusions" timeout 470 bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed|kernel tests|Error"
grep -E "^(FAILED|ERROR)" $OUT/fa56-*.log | cut -c1-200 | head -20
LB_KT="2048:4:bf16 4096:1:bf16" timeout 240 bash tests/device/cuda_run.sh fa56kernels 2>&1 | grep -E "^(bf16|lora)|^\| (kind|[a-zA-Z])" | head -40
rm -f $OUT/summary-*.log
