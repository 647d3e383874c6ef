"""Probe (device tool): flash_attn_ext's vjp forward and its gradient on CUDA0 under a causal mask plus noise, each
step printed, faulthandler's stack dumped if a step does not return (bench/results/h200-2026-11-28-fa74).

    python3 tests/device/fa_probe.py SECONDS B,H,HK,N,M,D,NOISE
"""

import faulthandler
import os
import sys
import time

import numpy as np

faulthandler.dump_traceback_later(float(sys.argv[1]), exit=True)
from llamabind import ops  # noqa: E402

b, h, hk, n, m, d = (int(x) for x in sys.argv[2].split(",")[:6])
noise = float(sys.argv[2].split(",")[6])
r = np.random.default_rng(1)
q = r.standard_normal((b, h, n, d)).astype(np.float32)
k, v = (r.standard_normal((b, hk, m, d)).astype(np.float32) for _ in range(2))
mask = (np.triu(np.full((n, m), -np.inf, np.float32), m - n + 1) + r.normal(0, noise, (n, m))).astype(np.float16)
print("env KEEP_STATS", os.environ.get("GGML_CUDA_FA_KEEP_STATS"), "shape", (b, h, hk, n, m, d, noise), flush=True)


def attn(q, k, v):
    return ops.flash_attn_ext(q, k, v, mask, scale=d**-0.5)


t0 = time.time()
y = np.asarray(ops.vjp(attn, q, k, v, backend="CUDA0")[0])
print("vjp forward done", time.time() - t0, float(np.abs(y).max()), flush=True)
g = ops.grad(lambda q, k, v: ops.sum(attn(q, k, v)), argnums=(0, 1, 2), backend="CUDA0")(q, k, v)
print("grad done", time.time() - t0, [float(np.abs(x).max()) for x in g], flush=True)
