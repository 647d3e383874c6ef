# issue 56, 2026-12-02 (second session), call 3 (right after call 2, warm): the 4096 x 1 and 256 x 8 rows with PyTorch
# bf16 and peft bf16 in the call (the defaults: every switch of patches 0092-0093 on)
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1; LB_BENCH="1b:4096:1 1b:256:8" LB_RUNNERS=full,lora,qlora LB_SETTINGS="GGML_CUDA_FA_KEEP_BF16=1,GGML_CUDA_CE_ARGMAX=1" timeout 400 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"; rm -f $OUT/summary-*.log $OUT/bench-train-raw.log
