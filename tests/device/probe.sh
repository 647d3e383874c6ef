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
for i in 0 1 2 3 4 5 6; do python3 -c "
import numpy as np
from llamabind import ops
bad = [lambda: ops.mul_mat(np.ones((2,3),np.float32), np.ones((2,3),np.float32)),
       lambda: ops.rope(np.ones((2,1,8),np.float32), np.arange(2,dtype=np.int32), 8, 'vision', sections=[0,0,0,4]),
       lambda: ops.repeat(np.ones(2, np.int64), (4,)),
       lambda: ops.concat(np.ones(2,np.int8), np.ones(2,np.int16)),
       lambda: ops.get_rows(np.ones((3,2),np.float32), np.array([-1],np.int32)),
       lambda: ops.flash_attn_ext(np.ones((1,3,2,8),np.float32), np.ones((1,2,2,8),np.float16), np.ones((1,2,2,8),np.float16)),
       lambda: ops.grad(lambda v: ops.sum(ops.tanh(v)))(np.ones(3,np.float32))]
try:
    bad[$i]()
except (ValueError, TypeError) as e:
    print('raised', type(e).__name__)
print('end of script')
" > /tmp/storm.out 2>&1; rc=$?; tail -2 /tmp/storm.out | tr '\n' ' '; echo "storm call $i rc=$rc"; done
python3 -c "import numpy as np; from llamabind import ops; print(ops.silu(np.ones(3, np.float32)))"; echo "plain op rc=$?"
echo "== README ops example"; bt /tmp/readme_ops.py
echo "== import sentencepiece, then llamabind"; bt -c "import sentencepiece; import llamabind._core"
