# issue 56, 2026-12-02, call 1 (bare machine): the build, then two steps of each runner at 2048 x 4 traced by CUPTI
# (bench/kernel_times.py --trace: the GPU's busy time, its idle gaps and the host's CUDA calls in them)
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/../../.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=60 LB_KERNEL_K="takes_32_keys_a_warp" timeout 420 bash tests/device/cuda_run.sh fa56 2>&1 \
  | grep -E "build rc|passed|failed|kernel tests|Error"
LB_KT_TRACE=1 LB_KT_ONLY_TRACE=1 LB_KT="2048:4:lora 2048:4:bf16 2048:4:qlora" timeout 170 bash tests/device/cuda_run.sh fa56kernels 2>&1 \
  | grep -vE "^(llama|load|print_info|common|ggml|init|srv|slot)" | tail -75
rm -f $OUT/summary-*.log $OUT/*.trace.json
