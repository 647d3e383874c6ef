# Sourced by cuda_run.sh on the device machine (CUDA 13, Python 3.12 with numpy, nanobind,
# scikit-build-core, pytest, hypothesis, ml_dtypes, torch; no network). Installs the carried wheels,
# unpacks the patched vendor tree and builds llamabind with CUDA for sm_90 plus upstream's tools
# into build/lb-cuda (once per machine: a warm machine keeps it, and the scikit-build-core build
# dir build/{wheel_tag} makes a rebuild incremental). Sets PYTHONPATH to use it. Expects OUT.
for w in .device/whl .device-b/whl; do
  [ -d $w ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $w/*.whl
done
export PYTHONPATH=/tmp/site
if [ ! -f vendor/llama.cpp/.llamabind-stamp.json ]; then
  mkdir -p vendor/llama.cpp && tar xJf .device/llama.cpp.tar.xz -C vendor/llama.cpp
fi
# LB_FAST_BUILD=1: no flash-attention kernels and no tools (training with composed attention only);
# LB_NO_TOOLS=1: no tools (training with flash attention, issue 56, needs the FA kernels)
export CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real${LB_FAST_BUILD:+ -DGGML_CUDA_FA=OFF}" \
  CMAKE_BUILD_PARALLEL_LEVEL=${LB_BUILD_JOBS:-$(nproc)} LLAMABIND_BUILD_TOOLS=$([ -n "${LB_FAST_BUILD:-}${LB_NO_TOOLS:-}" ] && echo OFF || echo ON)
if [ ! -f build/lb-cuda/.built ] && [ -z "${LB_NO_CUDA:-}" ]; then  # LB_NO_CUDA=1: Vulkan phases only
  t0=$SECONDS
  python3 -m pip install -v --no-build-isolation --no-deps --upgrade --target build/lb-cuda . > "$OUT/build.log" 2>&1 \
    && touch build/lb-cuda/.built
  echo "build rc=$? in $((SECONDS - t0)) s ($(nproc) jobs)"
fi
export PYTHONPATH=$PWD/build/lb-cuda:/tmp/site
export LLAMABIND_CACHE=/tmp/llamabind-cache PYTHONUNBUFFERED=1
