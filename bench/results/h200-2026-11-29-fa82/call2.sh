# issue 56, session 10, call 2 (bare machine): patch 0082's build, the flash-attention tests on CUDA0 (the new "long"
# cases among them), the two kernels' durations under Nsight Compute at 4 x 32 (8) x 2048 x 64 (call 1: before)
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_NO_TOOLS=1 LB_KERNEL_K="flash" LB_KERNEL_TIMEOUT=300 bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed|kernel tests|rror"
grep -E "NMSE|PASS|FAIL|passed|failed" $OUT/fa56-kernel-tests.log | tail -60 > $OUT/kernel-tests-0082.txt
export PYTHONPATH=$PWD/build/lb-cuda:/tmp/site LLAMABIND_CACHE=/tmp/llamabind-cache
timeout 150 ncu -k regex:"fa_fwd_mma|fa_back_mma_dkdv" --launch-count 2 --section SpeedOfLight --section LaunchStats \
  --section Occupancy --section WarpStateStats --section ComputeWorkloadAnalysis --section InstructionStats \
  python3 bench/attention_backward.py --runners llamabind --reps 1 > "$OUT/ncu-0082.txt" 2>&1
echo "ncu rc=$?"
grep -E "^  [a-z].*fa_|Duration|Registers Per|Achieved Occ|Theoretical Occ|Executed Instructions  |Issue Slots Busy|Warp Cycles Per Issued" "$OUT/ncu-0082.txt" | sed 's/(const void.*//' | head -30
