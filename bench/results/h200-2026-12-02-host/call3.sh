# issue 56, 2026-12-02, call 3 (right after call 2, warm): the 2048 x 4 rows with both patches off (the kernels and
# labels of before), on, and off again, no PyTorch (it ran in call 2)
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1; LB_BENCH=1b:2048:4 LB_RUNNERS=full,lora,qlora LB_TORCH_RUNS=none LB_SETTINGS="LLAMA_OPT_LABEL_CLASSES=0,GGML_CUDA_CE_BF16=0 LLAMA_OPT_LABEL_CLASSES=1 LLAMA_OPT_LABEL_CLASSES=0,GGML_CUDA_CE_BF16=0" timeout 330 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"; rm -f $OUT/summary-*.log $OUT/bench-train-raw.log
