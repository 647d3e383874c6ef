# Sourced by the device scripts: wheels from .device/whl, the patched vendor tree from
# .device/llama.cpp.tar.xz, and a CUDA (sm_90) build of llamabind with upstream's tools into
# build/lb-cuda; PYTHONPATH is set to use it. Expects OUT to be set.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl
mkdir -p vendor/llama.cpp && tar xJf .device/llama.cpp.tar.xz -C vendor/llama.cpp
export PYTHONPATH=/tmp/site
export CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90" CMAKE_BUILD_PARALLEL_LEVEL=16 LLAMABIND_BUILD_TOOLS=ON
t0=$SECONDS
python3 -m pip install -v --no-build-isolation --no-deps --target build/lb-cuda . > "$OUT/build.log" 2>&1
echo "build rc=$? in $((SECONDS - t0)) s"
export PYTHONPATH=$PWD/build/lb-cuda:/tmp/site
