# patch 0081 on a bare machine: the build and the kernel tests, bench rows with and without it (and PyTorch bf16 beside
# them), the LoRA step's kernels, then a mutant of each new kernel (expected: the rows cases fail)
[ -f build/lb-cuda/.built ] && { rm -rf vendor/llama.cpp build/lb-cuda; echo "warm machine: tree and build removed"; }
LB_NO_TOOLS=1 LB_KERNEL_K="rope or glu or rms_norm" bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed|kernel tests"
cp $OUT/fa56-kernel-tests.log $OUT/kernel-tests-0081.log
LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_NORM_ROWS=1 GGML_CUDA_NORM_ROWS=0" timeout 200 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
LB_KT=2048:4:lora timeout 120 bash tests/device/cuda_run.sh fa56kernels 2>&1 | grep -E "step|rms_norm|kind|---" | head -12
V=vendor/llama.cpp/ggml/src/ggml-cuda
python3 - <<'PY'
p = "vendor/llama.cpp/ggml/src/ggml-cuda/norm.cu"
s = open(p).read()
a = "    sum = warp_reduce_sum(sum);\n    const float scale = rsqrtf(sum/ncols + eps);\n\n    const float4 * m4"
b = "    sum_xg = warp_reduce_sum(sum_xg);\n\n    const float mean_eps   = sum_xx / ncols + eps;"
print("mutants:", s.count(a), s.count(b))
s = s.replace(a, a.replace("sum = warp_reduce_sum(sum);", "sum = sum*WARP_SIZE;"))
s = s.replace(b, b.replace("sum_xg = warp_reduce_sum(sum_xg);", "sum_xg = 0.0f;"))
open(p, "w").write(s)
PY
rm -rf build/lb-cuda
LB_NO_TOOLS=1 LB_KERNEL_K="rms_norm" bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed"
cp $OUT/fa56-kernel-tests.log $OUT/mutant-0081-kernel-tests.log
