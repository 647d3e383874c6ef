# issue 56, session 10, call 4 (bare machine): patch 0082 with cp.async pipelining on by default at D = 64: the flash
# tests (the unpipelined kernels too), bench/train.py's 2048 x 4 rows beside PyTorch bf16 / peft bf16, then a mutant of
# the dK/dV kernel's step scan (one round of 32 steps only: expected, the "long" gradient cases fail, the rest pass)
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_NO_TOOLS=1 LB_KERNEL_K="flash" bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed|kernel tests"
cp $OUT/fa56-kernel-tests.log $OUT/kernel-tests-0082c.log
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_FA_BACK_SPLIT=1" timeout 150 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
python3 - <<'PY'
p = "vendor/llama.cpp/ggml/src/ggml-cuda/fattn-back.cu"
s = open(p).read()
a = """    for (; it < n; it += WARP_SIZE) {
        bool open = false;"""
print("mutant sites:", s.count(a))
s = s.replace(a, a.replace("for (; it < n; it += WARP_SIZE) {", "for (int r = 0; r < 1 && it < n; ++r, it += WARP_SIZE) {"))
open(p, "w").write(s)
PY
touch vendor/llama.cpp/ggml/src/ggml-cuda/fattn-back.cu; rm -rf build/lb-cuda
LB_NO_TOOLS=1 LB_KERNEL_K="flash" timeout 150 bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed"
cp $OUT/fa56-kernel-tests.log $OUT/mutant-0082-kernel-tests.log; grep -E "^FAILED" $OUT/mutant-0082-kernel-tests.log | cut -c1-150
rm -f $OUT/summary-*.log $OUT/fa56-kernel-tests.log
