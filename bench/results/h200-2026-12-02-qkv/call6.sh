# issue 56, 2026-12-02 (second session), call 6 (warm): one QLoRA step's kernels at 2048 x 4 under Nsight Compute
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1; LB_KT=2048:4:qlora timeout 300 bash tests/device/cuda_run.sh fa56kernels 2>&1 | grep -vE "^(llama|load|print_info|common|ggml|init|patches)" | head -45; rm -f $OUT/summary-*.log
