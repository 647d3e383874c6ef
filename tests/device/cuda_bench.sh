#!/usr/bin/env bash
# CUDA generation benchmark for the device tool: build (as cuda_smoke.sh), write a random-weight
# llama 1B Q4_0 with bench/make_model.py, then bench/generation.py (llamabind vs llama-bench from the
# same tree, full offload: n_gpu_layers = -1 / -ngl 99). JSON and logs to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/llamabind-out}
mkdir -p "$OUT"
{
source "$(dirname "$0")/setup.sh"
t0=$SECONDS
python3 bench/make_model.py --size 1b --type q4_0 -o /tmp/llama-1b-q4_0.gguf --tokenizer-from .device/tokenizer.gguf
echo "model written in $((SECONDS - t0)) s"
python3 bench/generation.py --model /tmp/llama-1b-q4_0.gguf --threads 8 --rounds 3 --llama-cpp-python /nonexistent \
  --out "$OUT/h200-2026-11-21-random-llama-1b-q4_0.json"
} 2>&1 | tee "$OUT/summary.log"
