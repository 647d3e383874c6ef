# issue 56, session 10, call 3 (bare machine): patch 0082 (with fa_fwd_mma's smaller shared memory) built, the flash
# tests again, both kernels under Nsight Compute with and without cp.async pipelining, bench/train.py's 2048 x 4 rows
# beside PyTorch bf16 / peft bf16, then the LoRA step's kernels
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_NO_TOOLS=1 LB_KERNEL_K="flash" bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed|kernel tests"
cp $OUT/fa56-kernel-tests.log $OUT/kernel-tests-0082b.log
export PYTHONPATH=$PWD/build/lb-cuda:/tmp/site LLAMABIND_CACHE=/tmp/llamabind-cache
for p in 0 1; do
  GGML_CUDA_FA_FWD_PIPE=$p GGML_CUDA_FA_BACK_PIPE=$p timeout 100 ncu -k regex:"fa_fwd_mma|fa_back_mma_dkdv" --launch-count 2 \
    --section SpeedOfLight --section LaunchStats --section Occupancy \
    python3 bench/attention_backward.py --runners llamabind --reps 1 > "$OUT/ncu-0082-pipe$p.txt" 2>&1
  echo "pipe=$p"; grep -E "^  [a-z].*fa_|Duration|Registers Per|Achieved Occ" "$OUT/ncu-0082-pipe$p.txt" | sed 's/(const void.*//'
done
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_FA_FWD_PIPE=0" timeout 230 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
LB_KT=2048:4:lora timeout 100 bash tests/device/cuda_run.sh fa56kernels 2>&1 | grep -E "step|fa_|kind|---" | head -16
