#!/usr/bin/env bash
# CUDA generation benchmark for the device tool: build (as cuda_smoke.sh), write a random-weight
# llama 1B Q4_0 with bench/make_model.py, then bench/generation.py (llamabind vs llama-bench from the
# same tree, full offload: n_gpu_layers = -1 / -ngl 99). JSON and logs to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/llamabind-out}
mkdir -p "$OUT"
{
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device/whl/*.whl
export PYTHONPATH=/tmp/site
mkdir -p vendor/llama.cpp && tar xJf .device/llama.cpp.tar.xz -C vendor/llama.cpp
export CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90" CMAKE_BUILD_PARALLEL_LEVEL=16 LLAMABIND_BUILD_TOOLS=ON
t0=$SECONDS
python3 -m pip install -q --no-build-isolation --no-deps --target build/lb-cuda . > "$OUT/build.log" 2>&1
echo "build rc=$? in $((SECONDS - t0)) s"
export PYTHONPATH=$PWD/build/lb-cuda:/tmp/site
mkdir -p "$HOME/.cache/llamabind/models/smollm2-135m-instruct"
t0=$SECONDS
python3 bench/make_model.py --size 1b --type q4_0 -o /tmp/llama-1b-q4_0.gguf --tokenizer-from .device/tokenizer.gguf
echo "model written in $((SECONDS - t0)) s"
python3 bench/generation.py --model /tmp/llama-1b-q4_0.gguf --threads 8 --rounds 3 --llama-cpp-python /nonexistent \
  --out "$OUT/h200-2026-11-21-random-llama-1b-q4_0.json"
} 2>&1 | tee "$OUT/summary.log"
