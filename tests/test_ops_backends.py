"""Every non-CPU device of the build (CUDA, Metal, ...) against the CPU, by NMSE (test-backend-ops'
metric and limit). Skips cleanly on a CPU-only build; runs wherever a GPU backend is compiled in.
Covers the upstream fixes listed in patches/README.md on the GPU backends they concern."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import gpu_skip_reason

from llamabind import ops

GPUS = [d["name"] for d in ops.devices() if d["type"] != "cpu"]
pytestmark = pytest.mark.skipif(not GPUS, reason=gpu_skip_reason())
rng = np.random.default_rng(0)


def f32(*s):
    return rng.uniform(-1, 1, s).astype(np.float32)


CASES = [
    ("add", ops.add, (f32(4, 33), f32(33)), {}),
    ("mul_mat", ops.mul_mat, (f32(16, 64), f32(64, 24)), {}),
    ("silu", ops.silu, (f32(8, 100),), {}),
    ("soft_max", ops.soft_max, (f32(2, 4, 7),), {"scale": 0.5}),
    ("rms_norm", ops.rms_norm, (f32(6, 64),), {}),
    ("rms_norm_back", ops.rms_norm_back, (f32(6, 64), f32(6, 64)), {}),  # PR #24305
    ("soft_max_back", ops.soft_max_back, (f32(6, 64), ops.soft_max(f32(6, 64))), {}),
    ("rope", ops.rope, (f32(5, 2, 32), np.arange(5, dtype=np.int32), 32), {"mode": "neox"}),
    ("rope_back", ops.rope_back, (f32(5, 2, 32), np.arange(5, dtype=np.int32), 32), {"mode": "neox"}),  # PR #24725
    ("im2col_kw3_ic512", ops.im2col, (f32(8, 512, 3), f32(1, 512, 300), 1, 1, 1), {}),  # PR #24220
    ("get_rows", ops.get_rows, (f32(10, 16), np.array([3, 1, 9], np.int32)), {}),
]


def test_gpu_devices_listed():
    """Runs only where a GPU device exists (else skipped; a failure under LLAMABIND_REQUIRE_GPU=1)."""
    assert all(d["memory_total"] > 0 for d in ops.devices() if d["name"] in GPUS)


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("name,op,args,kw", CASES, ids=[c[0] for c in CASES])
def test_gpu_matches_cpu(device, name, op, args, kw):
    try:
        e = ops.check(op, *args, backend=device, **kw)
    except TypeError as err:  # not supported on this device: a clear error, never a crash
        pytest.skip(str(err))
    assert e < 1e-7, f"{name} on {device}: NMSE {e:.3g}"


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.int16, np.int32], ids=str)
def test_gpu_concat_every_dtype(device, dtype):  # PR #24724, #24747
    a = rng.integers(-50, 50, (3, 4, 5)).astype(dtype)
    b = rng.integers(-50, 50, (3, 2, 5)).astype(dtype)
    try:
        out = ops.concat(a, b, 1, backend=device)
    except TypeError as err:
        pytest.skip(str(err))
    np.testing.assert_array_equal(out.view(np.uint8), np.concatenate([a, b], 1).view(np.uint8))
