"""Probe: the biased-mask flash attention forward on CUDA0, step by step (hang hunt)."""
import faulthandler
import os
import sys
import time

import numpy as np

faulthandler.dump_traceback_later(float(sys.argv[1]) if len(sys.argv) > 1 else 30, exit=True)
from llamabind import ops  # noqa: E402

b, h, hk, n, m, d, noise = (int(x) if "." not in x else float(x) for x in sys.argv[2].split(","))
r = np.random.default_rng(1)
q = r.standard_normal((b, h, n, d)).astype(np.float32)
k, v = (r.standard_normal((b, hk, m, d)).astype(np.float32) for _ in range(2))
mask = (np.triu(np.full((n, m), -np.inf, np.float32), m - n + 1) + r.normal(0, noise, (n, m))).astype(np.float16)
print("env KEEP_STATS", os.environ.get("GGML_CUDA_FA_KEEP_STATS"), "shape", (b, h, hk, n, m, d, noise), flush=True)
t0 = time.time()
y = np.asarray(ops.vjp(lambda q, k, v: ops.flash_attn_ext(q, k, v, mask, scale=d**-0.5), q, k, v, backend="CUDA0")[0])
print("vjp forward done", time.time() - t0, float(np.abs(y).max()), flush=True)
g = ops.grad(lambda q, k, v: ops.sum(ops.flash_attn_ext(q, k, v, mask, scale=d**-0.5)), argnums=(0, 1, 2), backend="CUDA0")(q, k, v)
print("grad done", time.time() - t0, [float(np.abs(x).max()) for x in g], flush=True)
