# issue 56, session 11, call 4 (after call 3 on the warm machine): bench/train.py's 2048 x 4 rows with every fusion
# and with the norm-back fusion off (GGML_CUDA_FUSE_NORM_BACK=0), then the 4096 x 1 rows, PyTorch bf16 / peft bf16 in
# the same call each; the LoRA step's kernels; the README's fine-tuning command (CLI) at 4 x 2048
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_FUSE_NORM_BACK=1 GGML_CUDA_FUSE_NORM_BACK=0" \
  timeout 200 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
LB_BENCH=1b:4096:1 LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_FUSE_NORM_BACK=1" \
  timeout 120 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
LB_KT=2048:4:lora timeout 100 bash tests/device/cuda_run.sh fa56kernels 2>&1 | grep -E "^lora|^\| (kind|[a-zA-Z])" | head -16
OUT=$OUT bash .device/cli.sh
rm -f $OUT/summary-*.log $OUT/bench-train-raw.log
