# issue 56, 2026-12-01, call 5 (right after call 4, warm): the LoRA step's kernels at 4 x 2048 (Nsight Compute), then
# the README's fine-tuning command on CUDA (bench/results/h200-2026-11-29-fusions/cli.sh)
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/../../.."
LB_KT="2048:4:lora" timeout 150 bash tests/device/cuda_run.sh fa56kernels 2>&1 | grep -E "^(bf16|lora)|^\| (kind|[a-zA-Z])" | head -30
LB_CLI_TIMEOUT=150 bash bench/results/h200-2026-11-29-fusions/cli.sh
