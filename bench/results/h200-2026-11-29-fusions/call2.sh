# issue 56, session 11, call 2 (after call 1 on the warm machine): bench/train.py's 2048 x 4 rows (full, LoRA, QLoRA)
# with patch 0083's fusion and without (GGML_CUDA_FUSE_GEMM_ADD=0), PyTorch bf16 / peft bf16 in the same call, then
# the LoRA step's kernels (bench/kernel_times.py)
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_FUSE_GEMM_ADD=1 GGML_CUDA_FUSE_GEMM_ADD=0" \
  timeout 330 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
LB_KT=2048:4:lora timeout 200 bash tests/device/cuda_run.sh fa56kernels 2>&1 | head -30
rm -f $OUT/summary-*.log $OUT/bench-train-raw.log
