#!/usr/bin/env bash
# Which build change stops "import numpy; import llamabind" from crashing on the H200 image
# (SIGSEGV in a static std::regex initializer of _core while it is dlopen'ed)?
set -uo pipefail
OUT=${OUT:-/tmp/llamabind-out}; mkdir -p "$OUT"
[ -d .device/whl ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/whl/*.whl
mkdir -p vendor/llama.cpp && [ -f vendor/llama.cpp/.llamabind-stamp.json ] || tar xJf .device/llama.cpp.tar.xz -C vendor/llama.cpp
try() {
  for c in "import numpy; import llamabind._core" "import yaml; import llamabind._core" "import llamabind._core; import numpy"; do
    PYTHONPATH=$PWD/build/lb-cuda:/tmp/site python3 -c "$c; print('ok')" > /tmp/p.out 2>&1; echo "  [$1] $c -> rc=$? $(tail -c 80 /tmp/p.out | tr '\n' ' ')"
  done
}
build() {
  t0=$SECONDS
  CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 $1" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    python3 -m pip install -v --no-build-isolation --no-deps --target build/lb-cuda --upgrade . > "$OUT/build-$2.log" 2>&1
  echo "build $2 rc=$? in $((SECONDS - t0)) s"
}
build "-DGGML_CUDA_NCCL=ON" default; try default
ldd build/lb-cuda/llamabind/_core*.so | sed 's/^/    /'
build "-DGGML_CUDA_NCCL=ON -DCMAKE_MODULE_LINKER_FLAGS=-Wl,--exclude-libs,ALL" exclude-libs; try exclude-libs
build "-DGGML_CUDA_NCCL=OFF -DCMAKE_MODULE_LINKER_FLAGS=-Wl,--exclude-libs,ALL" no-nccl; try no-nccl
