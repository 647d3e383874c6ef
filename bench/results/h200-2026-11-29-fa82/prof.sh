# issue 56, session 10, call 1: a bare machine's build, then flash attention's training kernels (fa_fwd_mma,
# fa_back_mma_dkdv) under Nsight Compute's full set at 4 x 32 (8) x 2048 x 64, PyTorch SDPA bf16 beside them
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_NO_TOOLS=1 source tests/device/setup.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv
python3 bench/attention_backward.py --out "$OUT/ab.json" 2>&1 | tail -5
timeout 240 ncu -k regex:"fa_fwd_mma|fa_back_mma_dkdv" --launch-count 2 --set full \
  python3 bench/attention_backward.py --runners llamabind --reps 1 > "$OUT/ncu-full.txt" 2>&1
echo "ncu rc=$?"
grep -E "^  [a-z].*fa_|Duration|Registers Per|Achieved Occ|Theoretical Occ|Throughput  |Warp Cycles Per Issued|Issue Slots Busy|Shared.*Bank" "$OUT/ncu-full.txt" | head -60
