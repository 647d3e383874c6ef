"""Quantized weights in the backward pass (QLoRA): ggml_out_prod with a quantized, F16 or BF16
src0 (patches 0023 CPU, 0024 CUDA) against float64 with the weight dequantized by the gguf
package (an independent implementation of ggml's block formats), and the gradient of
``W_quantized @ x`` w.r.t. x. LLAMABIND_TEST_BACKEND=cuda runs them on the GPU as well as the CPU
(tests/device/cuda_run.sh qlora)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TEST_BACKEND, gpu_skip_reason

from llamabind import ops

gguf = pytest.importorskip("gguf")

QTYPES = ["q4_0", "q4_1", "q8_0", "q4_K", "q6_K"]
BACKENDS = ["cpu"] + ([TEST_BACKEND] if TEST_BACKEND and TEST_BACKEND != "cpu" else [])
# the CPU: sums of K float32 products against float64, relative error ~ sqrt(K) * 2^-24, far below
# 1e-4 of the largest value. GPUs: ggml-cuda's cuBLAS products run in TF32 (10-bit mantissa: 3e-4 of
# the largest value seen on an H100), so there the bound is on the NMSE, as test-backend-ops checks
# (a wrong block or row gives an NMSE near 1)
RTOL = 1e-4
GPU_NMSE = 1e-6


def _dequantized(w: ops.Blocks) -> np.ndarray:
    """float64 values of quantized rows, decoded by the gguf package (not by ggml)."""
    qt = gguf.GGMLQuantizationType[w.dtype.upper()]
    return gguf.quants.dequantize(w.data, qt).reshape(w.shape).astype(np.float64)


def _close(got, want, backend="cpu"):
    if backend == "cpu":
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= RTOL, err
    else:
        assert ops.nmse(got, want) <= GPU_NMSE, ops.nmse(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES + ["f16", "bf16"])
def test_out_prod_of_quantized_src0_matches_float64(qtype, backend):
    """ops.out_prod(a, b) = a.T @ b with b (ggml's src0) quantized: K = 100 rows (not a multiple of
    the 32 rows the CPU converts at a time), M = 130 outputs (more than the 64 dst rows one
    conversion serves, and split over threads), N = 256 values per row (the K-quants' block)."""
    rng = np.random.default_rng(0)
    k, m, n = 100, 130, 256
    a = rng.standard_normal((k, m)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    if qtype == "f16":
        b, b64 = w.astype(np.float16), w.astype(np.float16).astype(np.float64)
    elif qtype == "bf16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        b = w.astype(ml_dtypes.bfloat16)
        b64 = b.astype(np.float64)
    else:
        b = ops.as_blocks(w, qtype)
        b64 = _dequantized(b)
    got = ops.out_prod(a, b, backend=backend)
    assert got.shape == (m, n) and got.dtype == np.float32
    _close(got, a.astype(np.float64).T @ b64, backend)
    if backend != "cpu":  # test-backend-ops' metric and limit for out_prod
        assert ops.nmse(got, ops.out_prod(a, b, backend="cpu")) <= 5e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES)
def test_gradient_through_a_quantized_weight_matches_float64(qtype, backend):
    """d/dx sum(R * (W_q @ x)) = W^T R with W dequantized: what a LoRA's input gradient takes
    from the frozen quantized weight (ggml's MUL_MAT backward: OUT_PROD(W_q, grad^T))."""
    rng = np.random.default_rng(1)
    w = ops.as_blocks(rng.standard_normal((96, 512)).astype(np.float32), qtype)  # 96 outputs, 512 inputs
    x = rng.standard_normal((512, 7)).astype(np.float32)
    r = rng.standard_normal((96, 7)).astype(np.float32)
    dx = ops.grad(lambda x: ops.sum(ops.mul(ops.mul_mat(w, x), r)), backend=backend)(x)
    assert dx.shape == x.shape
    _close(dx, _dequantized(w).T @ r.astype(np.float64), backend)
    # the forward product too (ggml quantizes x to the weight's vec_dot type on the CPU: looser)
    y = ops.mul_mat(w, x, backend=backend)
    ref = _dequantized(w) @ x.astype(np.float64)
    assert np.abs(y - ref).max() / np.abs(ref).max() <= 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k,m,n", [(1, 1, 1), (37, 13, 45), (300, 7, 33), (5, 70, 16)])
def test_out_prod_at_any_shape_matches_float64(k, m, n, backend):
    """float32 out_prod at shapes that leave remainders in every tile of the CPU kernel (patch
    0023: 2 x GGML_F32_EPR outputs by 6 rows, blocks of 128 summed rows)."""
    rng = np.random.default_rng(k * m * n)
    a = rng.standard_normal((k, m)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    _close(ops.out_prod(a, b, backend=backend), a.astype(np.float64).T @ b.astype(np.float64), backend)


def test_quantized_operands_are_checked():
    w = ops.as_blocks(np.ones((4, 32), np.float32), "q8_0")
    with pytest.raises(ValueError, match="inner dimensions"):
        ops.mul_mat(w, np.ones((31, 2), np.float32))
    with pytest.raises(TypeError):
        ops.mul_mat(w, np.ones((32, 2), np.float16))
    with pytest.raises(ValueError, match="same first axis"):
        ops.out_prod(np.ones((3, 2), np.float32), w)
    with pytest.raises(ValueError, match="2-D"):
        ops.as_blocks(np.ones(32, np.float32), "q8_0")


_PLACEMENT = r"""
import logging, re, sys, collections
import llamabind
from llamabind import train
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(message)s")
with llamabind.Model(sys.argv[1], repack=False, n_gpu_layers=-1) as m:
    train.finetune(m, open(sys.argv[2], encoding="utf-8").read()[:3000], lora_rank=8, iters=1, val_split=0,
                   progress=False)
"""


def test_qlora_runs_every_node_on_the_gpu(model_path, vendor_dir, tmp_path):
    """patch 0024: one QLoRA step over the Q4_1 model (token_embd and the tied output Q8_0) fully
    offloaded: ggml's scheduler places no OUT_PROD and no MUL_MAT on the CPU (GGML_SCHED_DEBUG=2
    lists every node's backend). Before the patch each OUT_PROD of a quantized weight ran on the
    CPU, with the weight copied there every step."""
    import os
    import re
    import subprocess
    import sys

    import llamabind

    gpus = [d for d in llamabind.devices() if d["type"] == "gpu"]
    if not gpus:
        pytest.skip(gpu_skip_reason())
    env = {**os.environ, "GGML_SCHED_DEBUG": "2"}
    text = vendor_dir / "docs" / "build.md"
    p = subprocess.run(
        [sys.executable, "-c", _PLACEMENT, str(model_path), str(text)], capture_output=True, text=True, env=env,
        timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    nodes = re.findall(r"node #\s*\d+ \(\s*([A-Z_]+)\): .*?\[\s*(\S+)", p.stdout)
    assert any(op == "OUT_PROD" for op, _ in nodes), p.stdout[-2000:]  # the backward graph was listed
    on_cpu = sorted({op for op, backend in nodes if backend == "CPU" and op in ("OUT_PROD", "MUL_MAT")})
    if gpus[0]["name"].lower().startswith("vulkan"):
        pytest.xfail(f"Vulkan: {on_cpu} of quantized weights still run on the CPU (no quantized OUT_PROD there)")
    assert not on_cpu, f"on the CPU: {on_cpu}"
