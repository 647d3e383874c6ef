# issue 56, session 12, call 2 (bare machine): patches 0086-0088: the build, their GPU tests, a check that the ops
# test's graph takes the fused path (its log line), then bench/train.py's full fine-tune at 2048 x 4 with the three
# on and off (PyTorch bf16 in the same call)
set -uo pipefail
export OUT=${OUT:-/tmp/out} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
cd "$(dirname "$0")/.."
LB_NO_TOOLS=1 LB_KERNEL_TIMEOUT=100 LB_KERNEL_K="trained_rms_norm or rms_norm_back_of_a_weighted" \
  LB_TRAIN_K="norm_back or casts_of_trained or adamw_four or (product_inputs and model)" timeout 480 bash tests/device/cuda_run.sh fa56 2>&1 | grep -E "build rc|passed|failed|kernel tests|Error"
grep -E "^(FAILED|ERROR)" $OUT/fa56-*.log | cut -c1-300 | head -20
python3 - <<'PY' 2>&1 | grep -E "REPEAT_BACK|ok|Error" | cut -c1-200
import logging; logging.basicConfig(level=logging.INFO)
import numpy as np
from llamabind import ops
x = np.random.default_rng(0).standard_normal((37, 2048)).astype(np.float32); w = x[0].copy(); c = x[::-1].copy()
f = lambda x, w: ops.sum(ops.mul(ops.add(x, ops.mul(ops.rms_norm(x, 1e-6), w)), c))
print("ok", [a.shape for a in ops.grad(f, argnums=(0, 1), backend="CUDA0")(x, w)])
PY
LB_BENCH=1b:2048:4 LB_RUNNERS=full LB_SETTINGS="GGML_CUDA_FUSE_NORM_BACK=1 GGML_CUDA_FUSE_NORM_BACK=0,LLAMA_OPT_BF16_TRAINED=0,GGML_CUDA_ADAMW_VEC=0" \
  timeout 200 bash tests/device/cuda_run.sh fa69 2>&1 | grep -E "row done"
rm -f $OUT/summary-*.log
