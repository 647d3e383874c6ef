# issue 56, 2026-12-01, call 4 (right after call 3, warm): bench/train.py rows with PyTorch bf16 autocast + SDPA and
# peft bf16 in the same call: 2048 x 4 (and without patches 0088-0089, no PyTorch), 4096 x 1, 256 x 32
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/../../.."
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_FA_BACK_M32=1" \
  timeout 170 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_TORCH_RUNS=none LB_SETTINGS="GGML_CUDA_FA_BACK_M32=0,GGML_CUDA_GLU_VEC=0" \
  timeout 110 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
LB_BENCH=1b:4096:1 LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_FA_BACK_M32=1" \
  timeout 130 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
LB_BENCH=1b:256:32 LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_FA_BACK_M32=1" \
  timeout 150 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
rm -f $OUT/summary-*.log $OUT/bench-train-raw.log
