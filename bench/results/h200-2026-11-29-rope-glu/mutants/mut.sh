# mutants of patches 0078-0080 on a warm machine: each kernel broken as below, rebuilt, the kernel tests run
# (expected: the new cases fail), then the tree restored from the tarball and rebuilt
set -x
V=vendor/llama.cpp/ggml/src/ggml-cuda
sed -i 's/const int          hi = (p \/ 4) % 2;/const int          hi = 0;/' $V/convert.cu
sed -i 's/row = blockIdx.x\*blockDim.y + threadIdx.y;/row = blockIdx.x*blockDim.y;/' $V/rope.cu
sed -i 's/ggml_cuda_memcpy_1<16>(gv, g + row\*o1 + c);/ggml_cuda_memcpy_1<16>(gv, x + row*o0 + c);/' $V/unary.cu
grep -c "hi = 0;" $V/convert.cu; grep -c "row = blockIdx.x\*blockDim.y;" $V/rope.cu; grep -c "(gv, x + row\*o0 + c)" $V/unary.cu
set +x
rm -rf build/lb-cuda
LB_NO_TOOLS=1 LB_KERNEL_K="rope or glu or (q4_K and (many_columns or out_prod or gradient_through))" bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed|FAILED" | head -40
cp $OUT/fa56-kernel-tests.log $OUT/mutant-kernel-tests.log
tar xJf .device/llama.cpp.tar.xz -C vendor/llama.cpp
grep -c "hi = 0;" $V/convert.cu
rm -rf build/lb-cuda
LB_NO_TOOLS=1 LB_KERNEL_K="rope or glu" bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed" | head
