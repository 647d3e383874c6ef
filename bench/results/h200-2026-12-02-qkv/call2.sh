# issue 56, 2026-12-02 (second session), call 2 (right after call 1, warm): the four switches of patches 0092-0093 off
# (the kernels of before) / on / off again as bench/train.py rows at 2048 x 4 (no PyTorch), then the 2048 x 4 rows
# with PyTorch bf16 and peft bf16 in the call
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/../../.."
OFF=GGML_CUDA_FA_KEEP_BF16=0,GGML_CUDA_FA_FWD_Q_F32=0,GGML_CUDA_FA_TILES_ONCE=0,GGML_CUDA_CE_ARGMAX=0
ON=GGML_CUDA_FA_KEEP_BF16=1,GGML_CUDA_FA_FWD_Q_F32=1,GGML_CUDA_FA_TILES_ONCE=1,GGML_CUDA_CE_ARGMAX=1
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_TORCH_RUNS=none LB_SETTINGS="$OFF $ON $OFF" \
  timeout 300 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
mkdir -p $OUT/ab && mv $OUT/bench-train-settings* $OUT/train-*.json $OUT/ab/ 2>/dev/null
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_SETTINGS="$ON" \
  timeout 260 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
rm -f $OUT/summary-*.log $OUT/bench-train-raw.log
