#!/usr/bin/env bash
# Native backtraces (cuda-gdb, batch mode) of the two crashes seen on the H200 machine:
# a fresh interpreter running the README's ops example, and importing llamabind next to
# sentencepiece/torch. Sourced setup; run from the repository root.
set -uo pipefail
bt() { timeout 120 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex "bt 25" -ex "info sharedlibrary" \
  --args python3 "$@" 2>&1 | grep -v "^\[New Thread\|^\[Thread\|^warning:" | grep -A 60 "SIGSEGV\|signal" | head -90; }
python3 - > /tmp/readme_ops.py <<'PY'
import re; print(re.findall(r"```python\n(.*?)```", open("README.md").read(), re.S)[0])
PY
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -m pytest -q -p no:cacheprovider tests/test_ops_errors.py -k storm 2>&1 | tail -3
python3 -c "import numpy as np; from llamabind import ops; print(ops.silu(np.ones(3, np.float32)))"; echo "plain op rc=$?"
echo "== README ops example"; bt /tmp/readme_ops.py
echo "== import sentencepiece, then llamabind"; bt -c "import sentencepiece; import llamabind._core"
