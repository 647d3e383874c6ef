"""ggml-python 0.0.45 side of bench/ops.py (runs in bench/.venv-ggml-python): per-call time of a
64x64 float32 add, (1) the way ggml-python's API is used per call (context, tensors from numpy,
graph, compute, numpy copy out), (2) with one graph built once and only data copied per call.
Prints JSON: {"per_call_us": ..., "reused_graph_us": ...}."""

import json
import time

import ggml
import ggml.utils
import numpy as np

x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
MEM = 4 * 1024 * 1024


def per_call():
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=MEM, mem_buffer=None))
    a = ggml.utils.from_numpy(x, ctx)
    b = ggml.utils.from_numpy(x, ctx)
    c = ggml.ggml_add(ctx, a, b)
    gf = ggml.ggml_new_graph(ctx)
    ggml.ggml_build_forward_expand(gf, c)
    ggml.ggml_graph_compute_with_ctx(ctx, gf, 1)
    out = ggml.utils.to_numpy(c).copy()
    ggml.ggml_free(ctx)
    return out


ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=MEM, mem_buffer=None))
A, B = ggml.utils.from_numpy(x, ctx), ggml.utils.from_numpy(x, ctx)
C = ggml.ggml_add(ctx, A, B)
GF = ggml.ggml_new_graph(ctx)
ggml.ggml_build_forward_expand(GF, C)
VA, VB, VC = ggml.utils.to_numpy(A), ggml.utils.to_numpy(B), ggml.utils.to_numpy(C)


def reused():
    VA[:] = x
    VB[:] = x
    ggml.ggml_graph_compute_with_ctx(ctx, GF, 1)
    return VC.copy()


def us(fn, min_time=0.2):
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_time and n >= 10:
            return dt / n * 1e6


assert np.allclose(per_call(), 2 * x) and np.allclose(reused(), 2 * x)
print(json.dumps({"per_call_us": us(per_call), "reused_graph_us": us(reused)}))
