# issue 56, session 12, call 3 (after call 2 on the warm machine): each of patches 0086-0088 alone against all three
# (full, 2048 x 4), the 4096 x 1 full row, the full step's kernel table
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_BENCH=1b:4096:1 LB_RUNNERS=full LB_SETTINGS="GGML_CUDA_FUSE_NORM_BACK=1 GGML_CUDA_FUSE_NORM_BACK=0,LLAMA_OPT_BF16_TRAINED=0,GGML_CUDA_ADAMW_VEC=0" \
  timeout 160 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
LB_BENCH=1b:2048:4 LB_RUNNERS=full LB_SETTINGS="LLAMA_OPT_BF16_TRAINED=0 GGML_CUDA_ADAMW_VEC=0 GGML_CUDA_FUSE_NORM_BACK=0" \
  timeout 200 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
LB_KT="2048:4:bf16" timeout 120 bash tests/device/cuda_run.sh fa56kernels 2>&1 | grep -E "^(bf16|lora)|^\| (kind|[a-zA-Z])" | head -24
rm -f $OUT/summary-*.log
