# issue 56, session 11, call 5 (bare machine): patch 0083's norm-back fusion for rows of 4 * k floats (SmolLM2's 576):
# the build, the GPU tests of 0083-0085, then a mutant of the SwiGLU backward's BF16 copies (dG's copy written with
# dU's values: expected, test_bf16_copies_reused_within_a_step_change_nothing fails, the others pass)
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=200 LB_KERNEL_K="argmax or swiglu or out_prod or rms_norm or flash_attention_gradients or training_forward" \
  LB_TRAIN_K="fusions or reused or frozen" bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed|kernel tests|Error"
grep -E "^(FAILED|ERROR)" $OUT/fa56-*.log | cut -c1-200 | head -20
cp $OUT/fa56-train-tests.log $OUT/train-tests-0083.log; cp $OUT/fa56-kernel-tests.log $OUT/kernel-tests-0083.log
python3 - <<'PY'
p = "vendor/llama.cpp/ggml/src/ggml-cuda/unary.cu"
s = open(p).read()
a = "dg16[i] = ggml_cuda_cast<nv_bfloat16>(dgi);"
print("mutant sites:", s.count(a))
open(p, "w").write(s.replace(a, "dg16[i] = ggml_cuda_cast<nv_bfloat16>(dui);"))
PY
touch vendor/llama.cpp/ggml/src/ggml-cuda/unary.cu; rm -rf build/lb-cuda
LB_NO_TOOLS=1 LB_NO_KERNEL_TESTS=1 LB_KERNEL_K="swiglu_gradients" LB_TRAIN_K="reused or frozen" timeout 200 bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed"
cp $OUT/fa56-train-tests.log $OUT/mutant-swiglu-copies-train-tests.log; grep -E "^(FAILED|ERROR)" $OUT/mutant-swiglu-copies-train-tests.log | cut -c1-150
rm -f $OUT/summary-*.log $OUT/fa56-*.log
