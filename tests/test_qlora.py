"""Quantized weights in the backward pass (QLoRA): ggml_out_prod with a quantized, F16 or BF16
src0 (patches 0023 CPU, 0024 CUDA, 0026 Vulkan) against float64 with the weight dequantized by the gguf
package (an independent implementation of ggml's block formats), and the gradient of
``W_quantized @ x`` w.r.t. x. LLAMABIND_TEST_BACKEND=cuda|vulkan runs them on the GPU as well as
the CPU (tests/device/cuda_run.sh qlora / vulkanqlora; tests/test_vulkan.py on lavapipe)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, TEST_BACKEND, gpu_skip_reason

from llamabind import ops

gguf = pytest.importorskip("gguf")

QTYPES = ["q4_0", "q4_1", "q8_0", "q4_K", "q6_K"]
BACKENDS = ["cpu"] + ([TEST_BACKEND] if TEST_BACKEND and TEST_BACKEND != "cpu" else [])
# the CPU: sums of K float32 products against float64, relative error ~ sqrt(K) * 2^-24, far below
# 1e-4 of the largest value. GPUs: ggml-cuda's cuBLAS products run in TF32 (10-bit mantissa: 3e-4 of
# the largest value seen on an H100), so there the bound is on the NMSE, as test-backend-ops checks
# (a wrong block or row gives an NMSE near 1). With a quantized or BF16 src0 ggml-cuda multiplies in
# BF16 (patch 0039: both factors rounded to 8-bit mantissas; NMSE 5.5e-6 for Q4_0 on an H100).
RTOL = 1e-4
GPU_NMSE = 1e-6
CUDA_BF16_NMSE = 2e-5


def _dequantized(w: ops.Blocks) -> np.ndarray:
    """float64 values of quantized rows, decoded by the gguf package (not by ggml)."""
    qt = gguf.GGMLQuantizationType[w.dtype.upper()]
    return gguf.quants.dequantize(w.data, qt).reshape(w.shape).astype(np.float64)


def _close(got, want, backend="cpu", limit=GPU_NMSE):
    if backend == "cpu":
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err <= RTOL, err
    else:
        assert ops.nmse(got, want) <= limit, ops.nmse(got, want)


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
    bf16 = backend == "cuda" and qtype != "f16"  # patch 0039's BF16 product
    _close(got, a.astype(np.float64).T @ b64, backend, CUDA_BF16_NMSE if bf16 else GPU_NMSE)
    if backend != "cpu":  # test-backend-ops' metric and limit for out_prod
        assert ops.nmse(got, ops.out_prod(a, b, backend="cpu")) <= 5e-4


# grid-search IQ types: ggml's quantizer aborts on extreme values, so ops.quantize does not offer them;
# normal values quantize fine, made here by the extension's quantizer directly (the Vulkan kernel's
# init_iq_shmem path)
IQ_GRID = ["iq3_s", "iq3_xxs", "iq2_s", "iq1_m"]


def _blocks(w: np.ndarray, qtype: str) -> ops.Blocks:
    if qtype in ops.QUANT_TYPES:
        return ops.as_blocks(w, qtype)
    from llamabind import _core
    from llamabind.ops.graph import _TYPES

    tid, blck, size, _ = _TYPES[qtype]
    out = np.empty((w.shape[0], w.shape[1] // blck * size), np.uint8)
    _core.quantize_rows(tid, w, out)
    return ops.Blocks(out, qtype, w.shape)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", [t for t in ops.QUANT_TYPES if t not in QTYPES] + IQ_GRID)
def test_out_prod_of_every_block_type_matches_float64(qtype, backend):
    """The other block types ggml quantizes without an importance matrix (Q5_x, K-quants, IQ, TQ,
    MXFP4, NVFP4, Q1_0/Q2_0): ops.out_prod(a, b) with b quantized, against float64 over b decoded by
    the gguf package (by ggml's CPU get_rows for Q1_0/Q2_0, which gguf cannot decode); on a GPU
    also against the CPU's kernel by test-backend-ops' NMSE."""
    rng = np.random.default_rng(2)
    k, m, n = 40, 19, 256
    a = rng.standard_normal((k, m)).astype(np.float32)
    b = _blocks(rng.standard_normal((k, n)).astype(np.float32), qtype)
    try:
        b64 = _dequantized(b)
    except (NotImplementedError, KeyError):
        b64 = ops.dequantize(b.data, qtype, backend="cpu").astype(np.float64)  # q1_0, q2_0
    got = ops.out_prod(a, b, backend=backend)
    assert got.shape == (m, n)
    _close(got, a.astype(np.float64).T @ b64, backend, CUDA_BF16_NMSE if backend == "cuda" else GPU_NMSE)
    if backend != "cpu":
        assert ops.nmse(got, ops.out_prod(a, b, backend="cpu")) <= 5e-4


def _decoded(w: ops.Blocks) -> np.ndarray:
    """float64 values of quantized rows: the gguf package's decoding, or ggml's CPU one for the types gguf cannot
    decode (Q1_0, Q2_0)."""
    try:
        return _dequantized(w)
    except (NotImplementedError, KeyError):
        return ops.dequantize(w.data, w.dtype, backend="cpu").astype(np.float64).reshape(w.shape)


ALL_QTYPES = QTYPES + [t for t in ops.QUANT_TYPES if t not in QTYPES] + IQ_GRID


# every type on the CPU and CUDA; on Vulkan (lavapipe in CI: a software device, where 22 types took the test_vulkan
# run past its 30-minute limit on 2026-12-05) the five of QTYPES, the others' OUT_PROD being checked above
GRAD_CASES = [(t, b) for b in BACKENDS for t in (QTYPES if b == "vulkan" else ALL_QTYPES)]


@pytest.mark.parametrize("qtype,backend", GRAD_CASES)
def test_gradient_through_a_quantized_weight_matches_float64(qtype, backend):
    """d/dx sum(R * (W_q @ x)) = W^T R with W dequantized: what a LoRA's input gradient takes
    from the frozen quantized weight (ggml's MUL_MAT backward: OUT_PROD(W_q, grad^T)), for every block type ggml
    quantizes (issue 88: the K-quants, IQ, TQ, MXFP4/NVFP4, Q1_0/Q2_0 as much as Q4_0): a type whose weights a
    LoRA can be trained over has its gradient checked here."""
    rng = np.random.default_rng(1)
    w = _blocks(rng.standard_normal((96, 512)).astype(np.float32), qtype)  # 96 outputs, 512 inputs
    x = rng.standard_normal((512, 7)).astype(np.float32)
    r = rng.standard_normal((96, 7)).astype(np.float32)
    dx = ops.grad(lambda x: ops.sum(ops.mul(ops.mul_mat(w, x), r)), backend=backend)(x)
    assert dx.shape == x.shape
    _close(dx, _decoded(w).T @ r.astype(np.float64), backend, CUDA_BF16_NMSE if backend == "cuda" else GPU_NMSE)
    # the forward product too (ggml quantizes x to the weight's vec_dot type on the CPU: looser)
    y = ops.mul_mat(w, x, backend=backend)
    ref = _decoded(w) @ x.astype(np.float64)
    assert np.abs(y - ref).max() / np.abs(ref).max() <= 2e-2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("n", [255, 1100])
def test_forward_of_a_quantized_weight_over_many_columns_matches_float64(qtype, n, backend):
    """W_q @ x with 255 and 1100 columns: from 256 columns (a prompt's batch at the default n_ubatch, a
    training step's forward over QLoRA's frozen weights) patch 0047 has CUDA on an A100, H100/H200 or B200
    dequantize W to BF16 and multiply in BF16 with F32 accumulation through cuBLAS; below, and on other
    GPUs, MMQ. The CPU quantizes x to the weight's vec_dot type. Against float64 of the gguf package's
    dequantized W, and on a GPU against the CPU."""
    rng = np.random.default_rng(7)
    w = ops.as_blocks(rng.standard_normal((96, 256)).astype(np.float32), qtype)  # 96 outputs, 256 inputs
    x = rng.standard_normal((256, n)).astype(np.float32)
    y = ops.mul_mat(w, x, backend=backend)
    ref = _dequantized(w) @ x.astype(np.float64)
    assert y.shape == ref.shape
    # MMQ quantizes x to q8_1 (NMSE 2.9e-5 to 1.6e-4 on an H100), as the CPU to q8_0/q8_K; BF16 rounds
    # it to 8 mantissa bits: within patch 0039's bound, which MMQ misses for all five types
    full_rate = ("A100", "H100", "H200", "B200")  # BF16 products accumulated in F32 at full rate
    gpus = [d["description"] for d in ops.devices() if d["name"] == "CUDA0"]
    bf16 = backend == "cuda" and n >= 256 and any(k in g for g in gpus for k in full_rate)
    assert ops.nmse(y, ref) <= (CUDA_BF16_NMSE if bf16 else 5e-4), ops.nmse(y, ref)
    if backend != "cpu":
        assert ops.nmse(y, ops.mul_mat(w, x, backend="cpu")) <= 5e-4  # test-backend-ops' bound for MUL_MAT


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k,m,n", [(1, 1, 1), (37, 13, 45), (300, 7, 33), (5, 70, 16), (1100, 250, 40), (700, 200, 3)])
def test_out_prod_at_any_shape_matches_float64(k, m, n, backend):
    """float32 out_prod at shapes that leave remainders in every tile of the CPU kernel (patch
    0023: 2 x GGML_F32_EPR outputs by 6 rows, groups of 96 dst rows with their b values packed,
    blocks of up to 512 summed rows for float32: k = 1100 is three blocks, m = 250 several groups per
    thread)."""
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


def _placement(model: Path, text: Path) -> tuple[list[tuple[str, str, str]], str]:
    """(op, node name, backend) of every node ggml's scheduler placed in the training graphs of one
    QLoRA step over ``model`` fully offloaded (GGML_SCHED_DEBUG=2 lists them), and the log's tail."""
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "GGML_SCHED_DEBUG": "2"}
    p = subprocess.run(
        [sys.executable, "-c", _PLACEMENT, str(model), str(text)], capture_output=True, text=True, env=env,
        timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    # one listing per graph split, each from its split #0; the training step's are those with OUT_PROD
    # (the context's inference graphs, reserved before training starts, read the host's token_embd)
    node = r"node #\s*\d+ \(\s*([A-Z_]+)\):\s+(\S+) .*?\[\s*(\S+)"
    graphs = [re.findall(node, g) for g in p.stdout.split("## SPLIT #0:")]
    nodes = [n for g in graphs if any(op == "OUT_PROD" for op, _, _ in g) for n in g]
    return nodes, p.stdout[-2000:]


@pytest.mark.parametrize("which", ["default", "tiny"])
def test_qlora_runs_every_node_on_the_gpu(which, model_path, vendor_dir, tmp_path):
    """patches 0024 (CUDA) and 0026 (Vulkan): one QLoRA step fully offloaded places no node on the
    CPU; patch 0045: nor the input embedding lookup (GET_ROWS of the frozen token_embd, which
    llama.cpp keeps in host memory by design, reads the tied output layer's copy or a copy on the
    output layer's device once training starts). "default": SmolLM2's Q4_1 file (token_embd and
    the tied output Q8_0); "tiny": a random-weight Q4_0 llama of bench/make_model.py's tiny shape,
    the one run on lavapipe (the 135M step takes 15 minutes there). Before the patches each
    OUT_PROD of a quantized weight ran on the CPU with the weight copied there every step, and on
    Vulkan every OUT_PROD of a transposed gradient too."""
    import subprocess
    import sys

    import llamabind

    gpus = [d for d in llamabind.devices() if d["type"] == "gpu"]
    if not gpus:
        pytest.skip(gpu_skip_reason())
    model = model_path
    if which == "tiny":
        model = tmp_path / "tiny-q4_0.gguf"
        make = ROOT / "bench" / "make_model.py"
        subprocess.run(
            [sys.executable, str(make), "--size", "tiny", "--type", "q4_0", "-o", str(model)],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
    elif "llvmpipe" in gpus[0]["description"]:
        pytest.skip("lavapipe: the 135M model's step takes 15 minutes on the CPU's Vulkan; 'tiny' runs here")
    nodes, tail = _placement(model, vendor_dir / "docs" / "build.md")
    assert any(op == "OUT_PROD" for op, _, _ in nodes), tail  # the backward graph was listed
    on_cpu = sorted({(op, name) for op, name, backend in nodes if backend == "CPU"})
    assert not on_cpu, f"on the CPU: {on_cpu}"
    assert ("GET_ROWS", "embd") in {(op, name) for op, name, _ in nodes}, tail  # the lookup, on the GPU
