"""Every non-CPU device of the build (CUDA, Metal, ...) against the CPU, by NMSE (test-backend-ops'
metric and limit). Skips cleanly on a CPU-only build; runs wherever a GPU backend is compiled in.
Covers the upstream fixes listed in patches/README.md on the GPU backends they concern."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import gpu_skip_reason

from llamabind import ops
from llamabind.ops import eager

GPUS = [d["name"] for d in ops.devices() if d["type"] != "cpu"]
pytestmark = pytest.mark.skipif(not GPUS, reason=gpu_skip_reason())
rng = np.random.default_rng(0)


def f32(*s):
    return rng.uniform(-1, 1, s).astype(np.float32)


def _ce_logits(rows, classes):
    return rng.normal(0, 4, (rows, classes)).astype(np.float32)


def _onehot(rows, classes):
    y = np.zeros((rows, classes), np.float32)
    y[np.arange(rows), rng.integers(0, classes, rows)] = 1.0
    return y


def _classes(rows, classes):
    """int32 classes of each row, the last row's outside [0, classes) (a row of zeros)."""
    c = rng.integers(0, classes, rows).astype(np.int32)
    c[-1] = classes
    return c


def _soft(rows, classes):
    e = np.exp(rng.normal(0, 1, (rows, classes)))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def _bf16(*s):
    return f32(*s).astype(ml_dtypes.bfloat16)


_G = np.array([0.75], np.float32)

CASES = [
    ("add", ops.add, (f32(4, 33), f32(33)), {}),
    ("mul_mat", ops.mul_mat, (f32(16, 64), f32(64, 24)), {}),
    ("silu", ops.silu, (f32(8, 100),), {}),
    ("soft_max", ops.soft_max, (f32(2, 4, 7),), {"scale": 0.5}),
    ("rms_norm", ops.rms_norm, (f32(6, 64),), {}),
    ("rms_norm_back", ops.rms_norm_back, (f32(6, 64), f32(6, 64)), {}),  # PR #24305
    ("soft_max_back", ops.soft_max_back, (f32(6, 64), ops.soft_max(f32(6, 64))), {}),
    # patch 0043: rows kept in registers, a row over 128 threads (2048 columns), over two warps with two rows a
    # block and a last block of one (5 x 640); two passes for a length not a multiple of 4 (37) or over 16384
    ("soft_max_back_long_rows", ops.soft_max_back, (f32(9, 2048), ops.soft_max(f32(9, 2048))), {"scale": 0.125}),
    ("soft_max_back_two_warps", ops.soft_max_back, (f32(5, 640), ops.soft_max(f32(5, 640))), {}),
    ("soft_max_back_odd_rows", ops.soft_max_back, (f32(3, 7, 37), ops.soft_max(f32(3, 7, 37))), {}),
    ("soft_max_back_over_16384", ops.soft_max_back, (f32(2, 16400), ops.soft_max(f32(2, 16400))), {}),
    # patch 0045: a block per row, online max and sum, float4 loads where the row's length is a multiple of 4
    ("cross_entropy_loss", ops.cross_entropy_loss, (_ce_logits(7, 1000), _onehot(7, 1000)), {}),
    ("cross_entropy_loss_odd_row", ops.cross_entropy_loss, (_ce_logits(5, 1001), _soft(5, 1001)), {}),
    ("cross_entropy_loss_vocab_128256", ops.cross_entropy_loss, (_ce_logits(3, 128256), _onehot(3, 128256)), {}),
    ("cross_entropy_loss_back", ops.cross_entropy_loss_back, (_G, _ce_logits(7, 1000), _onehot(7, 1000)), {}),
    ("cross_entropy_loss_back_odd_row", ops.cross_entropy_loss_back, (_G, _ce_logits(5, 1001), _soft(5, 1001)), {}),
    (
        "cross_entropy_loss_back_vocab_128256",
        ops.cross_entropy_loss_back,
        (_G, _ce_logits(3, 128256), _onehot(3, 128256)),
        {},
    ),
    # patch 0090: the labels as the class of each row (int32), float4 loads of the logits and a row not a multiple of
    # 4; a class outside [0, classes) is a row of zeros
    ("cross_entropy_loss_classes", ops.cross_entropy_loss, (_ce_logits(7, 1000), _classes(7, 1000)), {}),
    ("cross_entropy_loss_classes_odd_row", ops.cross_entropy_loss, (_ce_logits(5, 1001), _classes(5, 1001)), {}),
    (
        "cross_entropy_loss_classes_vocab_128256",
        ops.cross_entropy_loss,
        (_ce_logits(3, 128256), _classes(3, 128256)),
        {},
    ),
    ("cross_entropy_loss_back_classes", ops.cross_entropy_loss_back, (_G, _ce_logits(7, 1000), _classes(7, 1000)), {}),
    (
        "cross_entropy_loss_back_classes_odd_row",
        ops.cross_entropy_loss_back,
        (_G, _ce_logits(5, 1001), _classes(5, 1001)),
        {},
    ),
    (
        "cross_entropy_loss_back_classes_vocab_49152",
        ops.cross_entropy_loss_back,
        (_G, _ce_logits(4, 49152), _classes(4, 49152)),
        {},
    ),
    ("rope", ops.rope, (f32(5, 2, 32), np.arange(5, dtype=np.int32), 32), {"mode": "neox"}),
    ("rope_back", ops.rope_back, (f32(5, 2, 32), np.arange(5, dtype=np.int32), 32), {"mode": "neox"}),  # PR #24725
    ("im2col_kw3_ic512", ops.im2col, (f32(8, 512, 3), f32(1, 512, 300), 1, 1, 1), {}),  # PR #24220
    ("get_rows", ops.get_rows, (f32(10, 16), np.array([3, 1, 9], np.int32)), {}),
    # patch 0075: F32 binary ops four elements a thread where rows are a multiple of 4 long and src1 repeats only
    # whole rows (same shape; repeated over dims 1 and 3; a norm weight over 37 rows; over heads), else the old kernel
    ("add_rows_vec4", ops.add, (f32(3, 5, 7, 8), f32(3, 5, 7, 8)), {}),
    ("mul_rows_vec4_repeated", ops.mul, (f32(3, 5, 7, 8), f32(5, 1, 8)), {}),
    ("sub_rows_vec4_norm_weight", ops.sub, (f32(37, 2048), f32(2048)), {}),
    ("div_rows_vec4_heads", ops.div, (f32(2, 6, 9, 64), rng.uniform(0.5, 2, (2, 1, 9, 64)).astype(np.float32)), {}),
    ("add_rows_vec4_long", ops.add, (f32(300, 4096), f32(300, 4096)), {}),
    # patch 0079: ROPE over rows of up to 512 values several rows a block (8 heads of 64, 4 of 128; 185 and 27 rows:
    # a last block short of rows), part of a head rotated (80 values, 32 rotated: pairs past the row and unrotated
    # ones), F16; rows of over 512 values by upstream's blocks
    ("rope_rows_head64", ops.rope, (f32(37, 5, 64), np.arange(37, dtype=np.int32), 64), {}),
    ("rope_back_rows_head64", ops.rope_back, (f32(37, 5, 64), np.arange(37, dtype=np.int32), 64), {}),
    ("rope_rows_head128_neox", ops.rope, (f32(9, 3, 128), np.arange(9, dtype=np.int32), 128), {"mode": "neox"}),
    (
        "rope_back_rows_head128_neox",
        ops.rope_back,
        (f32(9, 3, 128), np.arange(9, dtype=np.int32), 128),
        {"mode": "neox"},
    ),
    ("rope_rows_partial_head80", ops.rope, (f32(6, 3, 80), np.arange(6, dtype=np.int32), 32), {}),
    ("rope_rows_f16", ops.rope, (f32(11, 4, 64).astype(np.float16), np.arange(11, dtype=np.int32), 64), {}),
    ("rope_row_over_512", ops.rope, (f32(3, 2, 1040), np.arange(3, dtype=np.int32), 1040), {}),
    # patch 0080: gated activations 16 bytes a thread where rows are a multiple of 16 bytes (BF16 and F16 rows of 64
    # and 24, F32 rows of 8), else the general kernel (F32 rows of 30)
    ("swiglu_glu_vec_bf16", ops.swiglu, (_bf16(33, 64), _bf16(33, 64)), {}),
    ("swiglu_glu_vec_f16", ops.swiglu, (f32(7, 24).astype(np.float16), f32(7, 24).astype(np.float16)), {}),
    ("swiglu_glu_vec_f32", ops.swiglu, (f32(12, 8), f32(12, 8)), {}),
    ("swiglu_f32_odd_rows", ops.swiglu, (f32(5, 30), f32(5, 30)), {}),
    # patch 0081: RMS_NORM and RMS_NORM_BACK a warp per row of 128 * k floats up to 2048 (37 rows: a last block of one;
    # rows of 512 over channels and samples), else upstream's kernels (rows of 4096)
    ("rms_norm_rows_2048", ops.rms_norm, (f32(37, 2048),), {}),
    ("rms_norm_rows_channels_samples", ops.rms_norm, (f32(3, 5, 7, 512),), {}),
    ("rms_norm_back_rows_1024", ops.rms_norm_back, (f32(37, 1024), f32(37, 1024)), {}),
    ("rms_norm_back_rows_128", ops.rms_norm_back, (f32(9, 128), f32(9, 128)), {}),
    ("rms_norm_row_over_2048", ops.rms_norm, (f32(3, 4096),), {}),
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


_IDX = rng.integers(0, 700, 900).astype(np.int32)  # a 700-row table read 900 times: most rows several times
_PERM = rng.permutation(600).astype(np.int32)  # every row once, out of order (the last layer's inp_out_ids)
_W = {name: f32(*shape) for name, shape in (("rows", (900, 48)), ("norm", (300, 64)), ("heads", (2, 12, 5, 16)))}
_W["perm"] = f32(600, 40)
_CE_Y = _soft(6, 1000)
_CE_C = _classes(6, 1000)
GRAD_CASES = [  # training's backward kernels (patch 0034): GET_ROWS_BACK (token_embd) and REPEAT_BACK (broadcasts)
    ("get_rows_back", lambda x: ops.sum(ops.mul(ops.get_rows(x, _IDX), _W["rows"])), f32(700, 48)),
    ("get_rows_back_distinct", lambda x: ops.sum(ops.mul(ops.get_rows(x, _PERM), _W["perm"])), f32(600, 40)),
    ("cross_entropy_loss_grad", lambda x: ops.cross_entropy_loss(x, _CE_Y), f32(6, 1000)),
    ("cross_entropy_loss_grad_classes", lambda x: ops.cross_entropy_loss(x, _CE_C), f32(6, 1000)),  # patch 0090
    ("repeat_back_rows", lambda x: ops.sum(ops.mul(ops.repeat(x, (300, 64)), _W["norm"])), f32(64)),
    ("repeat_back_heads", lambda x: ops.sum(ops.mul(ops.repeat(x, (2, 12, 5, 16)), _W["heads"])), f32(2, 3, 5, 16)),
    # RMS_NORM_BACK and SOFT_MAX_BACK (Metal: patch 0058)
    (
        "rms_norm_soft_max_grad",
        lambda x: ops.sum(ops.mul(ops.soft_max(ops.rms_norm(x, 1e-6)), _W["norm"])),
        f32(300, 64),
    ),
]


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("name,f,x", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_gpu_gradients_match_cpu(device, name, f, x):
    """The gradient (ggml's backward graph) on the device against the CPU's, by NMSE."""
    try:
        got = ops.grad(f, backend=device)(x)
    except TypeError as err:  # a backward op the device does not run: a clear error, never a crash
        pytest.skip(str(err))
    e = ops.nmse(got, ops.grad(f, backend="cpu")(x))
    assert e < 1e-7, f"{name} on {device}: NMSE {e:.3g}"


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize(
    "b,h,hk,n,m,d,kv",
    [
        (1, 4, 4, 256, 256, 64, np.float32),  # one training window
        (2, 8, 2, 300, 300, 128, np.float32),  # grouped-query heads, two sequences, a partial last tile
        (1, 2, 1, 77, 200, 64, np.float16),  # F16 K/V, more keys than queries, rows of few keys
        (1, 2, 1, 2200, 2200, 64, np.float32),  # 35 blocks: runs of over 32 masked tiles (a warp's scan)
    ],
    ids=["window", "gqa-d128", "f16-ragged", "long"],
)
@pytest.mark.parametrize(
    "dq_order", ["atomic", "atomic-per-kv-head", "fixed", "stats-recomputed", "no-cp-async", "64-keys-a-block"]
)
def test_gpu_flash_attention_gradients_match_cpu(device, b, h, hk, n, m, d, kv, dq_order, monkeypatch):
    """Patches 0051, 0065, 0067 and 0074: FLASH_ATTN_BACK on the device (CUDA: BF16 tensor-core operands, F32
    accumulation) against the CPU's F32 kernel (patch 0050), dq, dk and dv under a causal mask, with dQ
    summed each way CUDA has: added by atomics in the dK/dV kernel, whose blocks take one query head each
    and add dK and dV by atomics too (the default), or one K/V head each (GGML_CUDA_FA_BACK_SPLIT=0; the
    same where h == hk), and in a fixed order by a second sweep (GGML_CUDA_FA_BACK_DETERMINISTIC=1); the
    log-sum-exp and the mask's tile classes kept by the forward (patch 0074, the default) or recomputed by
    the backward (GGML_CUDA_FA_KEEP_STATS=0: the forward by the inference kernels); the forward's and the
    backward's tiles loaded by cp.async into two buffers (the default at head size 64, patch 0082) or not
    (GGML_CUDA_FA_FWD_PIPE=0, GGML_CUDA_FA_BACK_PIPE=0); at head size 64 the dK/dV kernel that adds dQ by atomics
    takes 128 keys a block, 32 a warp (patch 0088, the default: "window" one K/V head a query head, "f16-ragged" a last
    block of 72 keys whose second half lies outside the keys, "long" 18 blocks, the last of 24 keys) or 64 keys a
    block, 16 a warp (GGML_CUDA_FA_BACK_M32=0). Patch 0092 (the default in every case but "stats-recomputed"): the
    forward reads Q's F32 rows itself and keeps the BF16 Q, K and V (F16 K/V in "f16-ragged") that the backward then
    reads instead of converting them again. "long": 2200 queries and
    keys, 35 blocks of 64: the first query block's forward and the last key block's dK/dV kernel skip 34
    masked tiles, more than the 32 that a warp's lanes look at at once (patch 0082); 2200 is not a
    multiple of 64 (the checked tile loads), every other tile takes the unchecked ones.
    NMSE limit 1e-4: BF16 rounds each operand to
    8 significant bits (relative error 2^-9); the sums of a few hundred such products keep the error of
    each output near 1e-3 relative, NMSE ~1e-5 (measured on an H100: 0.9-2.2e-5); a wrong tile or index
    is O(1)."""
    if dq_order == "fixed":
        if not device.startswith("CUDA"):
            pytest.skip("the fixed-order dQ is CUDA's setting")
        monkeypatch.setenv("GGML_CUDA_FA_BACK_DETERMINISTIC", "1")
    if dq_order == "atomic-per-kv-head":
        if not device.startswith("CUDA") or h == hk:
            pytest.skip("a CUDA setting for grouped-query heads")
        monkeypatch.setenv("GGML_CUDA_FA_BACK_SPLIT", "0")
    if dq_order == "stats-recomputed":
        if not device.startswith("CUDA"):
            pytest.skip("a CUDA setting")
        monkeypatch.setenv("GGML_CUDA_FA_KEEP_STATS", "0")
    if dq_order == "no-cp-async":  # (the default at head size 64 is the pipelined pair, patch 0082)
        if not device.startswith("CUDA"):
            pytest.skip("a CUDA setting")
        monkeypatch.setenv("GGML_CUDA_FA_FWD_PIPE", "0")
        monkeypatch.setenv("GGML_CUDA_FA_BACK_PIPE", "0")
    if dq_order == "64-keys-a-block":  # (the default at head size 64 takes 128, patch 0088)
        if not device.startswith("CUDA") or d != 64:
            pytest.skip("a CUDA setting at head size 64")
        monkeypatch.setenv("GGML_CUDA_FA_BACK_M32", "0")
    got, want = _flash_attention_gradients(device, b, h, hk, n, m, d, kv)
    for name, g, r in zip("qkv", got, want):
        e = ops.nmse(g, r)
        print(f"d{name}: NMSE {e:.2e}")
        assert e < 1e-4, f"d{name} on {device}: NMSE {e:.3g}"


def _flash_attention_gradients(device, b, h, hk, n, m, d, kv, cpu=True):
    """dq, dk, dv of sum(flash_attn_ext(q, k, v, causal mask) * w) on device (and on the CPU, or None)."""
    rng = np.random.default_rng(n + m + d)
    q = rng.standard_normal((b, h, n, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, hk, m, d)).astype(kv) for _ in range(2))
    mask = np.triu(np.full((n, m), -np.inf, np.float32), m - n + 1)
    mask = mask.astype(np.float16)
    w = rng.standard_normal((b, h, n, d)).astype(np.float32)

    def loss(q, k, v):
        return ops.sum(ops.mul(ops.flash_attn_ext(q, ops.cast(k, kv), ops.cast(v, kv), mask, scale=d**-0.5), w))

    args = (q, k.astype(np.float32), v.astype(np.float32))
    try:
        got = ops.grad(loss, argnums=(0, 1, 2), backend=device)(*args)
    except TypeError as err:  # no backward for this on the device: a clear error, never a crash
        pytest.skip(str(err))
    return got, ops.grad(loss, argnums=(0, 1, 2), backend="cpu")(*args) if cpu else None


@pytest.mark.parametrize("device", [g for g in GPUS if g.startswith("CUDA")] or ["CUDA0"])
@pytest.mark.parametrize(
    "b,h,hk,n,m,d,kv,noise",
    [
        (1, 4, 4, 256, 256, 64, np.float32, 0.0),  # one training window: open, masked and diagonal tiles
        (2, 8, 2, 300, 300, 128, np.float32, 0.0),  # grouped-query heads, two sequences, a partial last tile
        (1, 2, 1, 77, 200, 64, np.float16, 0.0),  # F16 K/V, more keys than queries, rows of few keys
        (2, 4, 2, 130, 130, 64, np.float32, 0.5),  # finite mask entries in every tile (ALiBi-free bias)
        (1, 2, 1, 2200, 2200, 64, np.float32, 0.0),  # runs of over 32 masked tiles (patch 0082's warp scan)
    ],
    ids=["window", "gqa-d128", "f16-ragged", "biased", "long"],
)
def test_gpu_flash_attention_training_forward_matches_float64(device, b, h, hk, n, m, d, kv, noise, monkeypatch):
    """Patch 0074 (CUDA): a FLASH_ATTN_EXT that a backward pass reads (here vjp's graph) runs the training
    forward, FlashAttention-2's forward on the backward's BF16 tiles, keeping each row's log-sum-exp and the
    mask's tile classes past its result for FLASH_ATTN_BACK. Its output against softmax(scale q k^T + mask) v
    in float64, NMSE limit 1e-4 (BF16 operands round to 8 significant bits, relative error 2^-9; P in BF16
    too: NMSE ~1e-5; a wrong tile, row or rescaling is O(1)); and not the bits of the inference kernels
    (GGML_CUDA_FA_KEEP_STATS=0: F16 operands), so the training forward is the kernel that ran. "long": the
    first query block's forward skips 34 masked key blocks after its diagonal, more than a warp's 32-lane scan
    (patch 0082). (Not for the
    biased mask: there the inference kernels did not return on an H200, lease 3 of
    bench/results/h200-2026-11-28-fa74, while the training forward and backward did.)"""
    if device not in GPUS:
        pytest.skip(f"no {device}")
    from test_ops_grad import _attention_f64

    r = np.random.default_rng(n * m + d)
    q = r.standard_normal((b, h, n, d)).astype(np.float32)
    k, v = (r.standard_normal((b, hk, m, d)).astype(kv).astype(np.float32) for _ in range(2))
    mask = np.triu(np.full((n, m), -np.inf, np.float32), m - n + 1) + r.normal(0, noise, (n, m))
    mask = mask.astype(np.float16)

    def attn(q, k, v):
        return ops.flash_attn_ext(q, ops.cast(k, kv), ops.cast(v, kv), mask, scale=d**-0.5)

    got = np.asarray(ops.vjp(attn, q, k, v, backend=device)[0])
    want = _attention_f64(q, k, v, mask.astype(np.float32), d**-0.5)
    e = ops.nmse(got, want)
    print(f"O: NMSE {e:.2e}")
    assert got.shape == want.shape and e < 1e-4, f"NMSE {e:.3g}"
    if noise:
        return
    monkeypatch.setenv("GGML_CUDA_FA_KEEP_STATS", "0")
    inference = np.asarray(ops.vjp(attn, q, k, v, backend=device)[0])
    assert ops.nmse(inference, want) < 1e-4 and not np.array_equal(got, inference)


@pytest.mark.parametrize("device", [g for g in GPUS if g.startswith("CUDA")] or ["CUDA0"])
def test_gpu_flash_attention_fixed_order_is_deterministic(device, monkeypatch):
    """Patch 0065 (CUDA): with GGML_CUDA_FA_BACK_DETERMINISTIC=1 each gradient element is summed by one
    warp in a fixed order, so two runs give the same bits (the default adds dQ's parts by atomics, in
    whatever order the blocks reach them). Two sequences of 300 rows, grouped-query heads: 5 key blocks
    add to each query block's dQ."""
    if device not in GPUS:
        pytest.skip(f"no {device}")
    monkeypatch.setenv("GGML_CUDA_FA_BACK_DETERMINISTIC", "1")
    first, _ = _flash_attention_gradients(device, 2, 8, 2, 300, 300, 64, np.float32, cpu=False)
    again, _ = _flash_attention_gradients(device, 2, 8, 2, 300, 300, 64, np.float32, cpu=False)
    for name, a, b in zip("qkv", first, again):
        np.testing.assert_array_equal(a, b, err_msg=f"d{name}")


_FA_BACK_M32_RUN = """
import json, logging, sys
import numpy as np
logging.basicConfig(level=logging.INFO)
sys.path.insert(0, {tests!r})
import test_ops_backends as t
got, _ = t._flash_attention_gradients({device!r}, 2, 8, 2, 300, 300, 64, np.float32, cpu=False)
np.save({out!r}, np.concatenate([g.ravel() for g in got]))
"""


@pytest.mark.parametrize("device", [g for g in GPUS if g.startswith("CUDA")] or ["CUDA0"])
def test_gpu_flash_attention_backward_takes_32_keys_a_warp_by_default(device, tmp_path):
    """Patch 0088 (CUDA): at head size 64 the dK/dV kernel of the default backward (dQ by atomics, pipelined loads)
    takes 128 keys a block, 32 a warp, and says so once at INFO; GGML_CUDA_FA_BACK_M32=0 runs the 64-key kernel and
    logs nothing. Each run its own process: dq, dk and dv of two sequences of 300 rows (grouped-query heads, a last
    block of 44 keys) agree to 1e-10 NMSE (the same arithmetic for each product; the atomics add dQ's and the query
    heads' dK and dV parts in whatever order the blocks reach them, and the 128-key kernel adds dQ over 128 keys
    before its atomics where the other adds twice: F32 rounding, ~1e-14), and each kernel's values are checked
    against the CPU by test_gpu_flash_attention_gradients_match_cpu."""
    if device not in GPUS:
        pytest.skip(f"no {device}")
    import os
    import pathlib

    from conftest import run_python

    grads, logged = {}, {}
    for m32 in ("1", "0"):
        out = tmp_path / f"g{m32}.npy"
        code = _FA_BACK_M32_RUN.format(tests=str(pathlib.Path(__file__).parent), device=device, out=str(out))
        p = run_python(code, timeout=300, env={**os.environ, "GGML_CUDA_FA_BACK_M32": m32})
        assert p.returncode == 0, p.stderr[-2000:]
        grads[m32] = np.load(out)
        logged[m32] = "dK and dV with 128 keys a block, 32 a warp" in p.stderr
    assert logged == {"1": True, "0": False}, logged
    assert ops.nmse(grads["1"], grads["0"]) < 1e-10


_FA_FWD_RUN = """
import logging, sys
import numpy as np
logging.basicConfig(level=logging.INFO)
sys.path.insert(0, {tests!r})
import test_ops_backends as t
grads, _ = t._flash_attention_gradients({device!r}, 2, 8, 2, 300, 300, 128, np.float32, cpu=False)
np.savez({out!r}, *t._training_forward({device!r}), *grads)
"""


def _training_forward(device):
    """The training forward's O (vjp's graph: FLASH_ATTN_EXT read by its backward) at head sizes 64 and 128, causal,
    grouped-query heads, a last query and key tile of 44 rows, and the float64 references."""
    from test_ops_grad import _attention_f64

    outs = []
    for b, h, hk, n, d in ((2, 8, 2, 300, 64), (1, 4, 1, 300, 128)):
        r = np.random.default_rng(n + d)
        q, k, v = (r.standard_normal((b, x, n, d)).astype(np.float32) for x in (h, hk, hk))
        mask = np.triu(np.full((n, n), -np.inf, np.float32), 1).astype(np.float16)

        def attn(q, k, v, mask=mask, d=d):
            return ops.flash_attn_ext(q, k, v, mask, scale=d**-0.5)

        outs += [np.asarray(ops.vjp(attn, q, k, v, backend=device)[0]), _attention_f64(q, k, v, mask, d**-0.5)]
    return outs


def _cuda_runs(device, tmp_path, template: str, n: int, envs: dict[str, dict], hopper=True) -> tuple[dict, dict]:
    """For each name -> environment of ``envs`` (added to this process's; a variable set to None is removed),
    ``template`` (a script writing ``n`` arrays to {out!r}) run on a Hopper ``device`` (any GPU with
    ``hopper=False``) in a process of its own: (name -> the arrays, name -> its stderr); skips on other GPUs."""
    if device not in GPUS:
        pytest.skip(f"no {device}")
    desc = next(d["description"] for d in ops.devices() if d["name"] == device)
    if hopper and not any(x in desc for x in ("H100", "H200", "H800", "H20")):
        pytest.skip(f"{desc}: not a Hopper GPU (compute capability 9.0)")
    import os
    import pathlib

    from conftest import run_python

    arrays, stderr = {}, {}
    for name, env in envs.items():
        out = tmp_path / f"{name.replace('/', '-')}.npz"  # (names such as "default/0")
        code = template.format(tests=str(pathlib.Path(__file__).parent), device=device, out=str(out))
        full = {k: v for k, v in {**os.environ, **env}.items() if v is not None}
        p = run_python(code, timeout=300, env=full)
        assert p.returncode == 0, p.stderr[-2000:]
        with np.load(out) as z:
            arrays[name] = [z[f"arr_{i}"] for i in range(n)]
        stderr[name] = p.stderr
    return arrays, stderr


@pytest.mark.parametrize("device", [g for g in GPUS if g.startswith("CUDA")] or ["CUDA0"])
def test_gpu_flash_attention_training_kernels_on_warpgroup_products(device, tmp_path):
    """Patch 0099 (CUDA, compute capability 9.0): the training forward, and at head size 128 the backward's dK/dV
    kernel that sums dQ, run on Hopper's warpgroup products (wgmma, sm_90a; ggml-cuda's build compiles 90 as 90a) by
    default and say so once at INFO; GGML_CUDA_FA_FWD_WGMMA=0 and GGML_CUDA_FA_BACK_WGMMA=0 run the mma.sync kernels
    and log neither. Each run its own process. O at head sizes 64 and 128: both within 1e-4 NMSE of float64 (BF16
    operands: ~1e-6 here) and the two kernels within 1e-12 of each other (the same BF16 operands and F32
    accumulation; bit for bit on an H200, tests/device/fa_harness.py --forward). dq, dk, dv at head size 128 (two
    sequences of 300 rows, grouped-query heads, a last block of 44 keys) within 1e-10 of each other (dQ, and dK and
    dV of the query heads, added by atomics in whatever order the blocks reach them: F32 rounding, ~1e-14);
    test_gpu_flash_attention_gradients_match_cpu checks the default's against the CPU."""
    envs = {on: {"GGML_CUDA_FA_FWD_WGMMA": on, "GGML_CUDA_FA_BACK_WGMMA": on} for on in ("1", "0")}
    outs, err = _cuda_runs(device, tmp_path, _FA_FWD_RUN, 7, envs)
    lines = ("the training forward on warpgroup", "the dK/dV kernel (D = 128) on warp")
    logged = {on: [x in err[on] for x in lines] for on in envs}
    assert logged == {"1": [True, True], "0": [False, False]}, logged
    for i, d in enumerate((64, 128)):
        got, mma, want = outs["1"][2 * i], outs["0"][2 * i], outs["1"][2 * i + 1]
        assert got.shape == want.shape and ops.nmse(got, want) < 1e-4, (d, ops.nmse(got, want))
        assert ops.nmse(mma, want) < 1e-4 and ops.nmse(got, mma) < 1e-12, (d, ops.nmse(got, mma))
    for name, got, mma in zip("qkv", outs["1"][4:], outs["0"][4:]):
        assert got.shape == mma.shape and ops.nmse(got, mma) < 1e-10, (name, ops.nmse(got, mma))


_FA_BACK_RUN = """
import logging, sys
import numpy as np
logging.basicConfig(level=logging.INFO)
sys.path.insert(0, {tests!r})
import test_ops_backends as t
out = []
for d in (64, 128):
    out += list(t._flash_attention_gradients({device!r}, 2, 8, 2, 300, 300, d, np.float32, cpu=False)[0])
np.savez({out!r}, *out)
"""


@pytest.mark.parametrize("device", [g for g in GPUS if g.startswith("CUDA")] or ["CUDA0"])
def test_gpu_flash_attention_backward_with_bulk_dq(device, tmp_path):
    """Patch 0100's dK/dV kernel on warpgroup products with dQ added by the TMA unit's bulk reductions
    (fa_back_wgmma_dkdv<D, true>: cp.reduce.async.bulk .add.f32 of each step's 64 x 64 F32 chunk through the step's
    spent Q and dO tiles, as FlashAttention-3 adds dQ), at head sizes 64 and 128 (CUDA, compute capability 9.0):
    GGML_CUDA_FA_BACK_BULK_DQ=1 runs it and says so once at INFO, off by default (it replaces fa_back_mma_dkdv2 at 64
    and the atomics kernel at 128 only once measured faster). Each run its own process: dq, dk, dv (two sequences of
    300 rows, grouped-query heads, a last block of 44 keys, causal) within 1e-10 NMSE of the default kernels' (dQ
    summed in F32 in whatever order the blocks reach it: ~1e-14), which test_gpu_flash_attention_gradients_match_cpu
    checks against the CPU."""
    envs = {on: {"GGML_CUDA_FA_BACK_BULK_DQ": on} for on in ("1", "0")}
    grads, err = _cuda_runs(device, tmp_path, _FA_BACK_RUN, 6, envs)
    logged = {on: "the dK/dV kernel with dQ by bulk reductions on warp" in err[on] for on in envs}
    assert logged == {"1": True, "0": False}, logged
    for i, (bulk, default) in enumerate(zip(grads["1"], grads["0"])):
        what = ("dq", "dk", "dv")[i % 3], (64, 128)[i // 3]
        assert bulk.shape == default.shape and ops.nmse(bulk, default) < 1e-10, (what, ops.nmse(bulk, default))


@pytest.mark.parametrize("device", [g for g in GPUS if g.startswith("CUDA")] or ["CUDA0"])
def test_gpu_flash_attention_backward_with_its_blocks_in_chunks_of_key_blocks(device, tmp_path):
    """Patch 0106 (CUDA): GGML_CUDA_FA_BACK_KB_CHUNK=C dispatches the training backward's dK/dV blocks in chunks of C
    key blocks (a 1D grid: the heads fastest across chunks, the key blocks within one; each block decodes its head,
    sequence and key block from its place, fab_kv_block), so that the blocks running at once share their Q, dO and
    dQ tiles through the L2 cache, and says so once at INFO; 0: the heads-fastest 3D grid; unset (the default):
    "auto" for the 64-key kernels, the heads fastest for the 128-key one at head size 64 (fa_back_mma_dkdv2), and an
    INFO line that says so. Each run its own process, at head sizes 64 and 128 (two sequences of 300 rows: 5 blocks
    of 64 keys, 3 of 128, grouped-query heads, a last block of 44 keys, causal), C = 2 (a shorter last chunk),
    "auto" (max(8, key blocks / 8): here every key block of a head before the next) and unset: with the default
    kernels (fa_back_mma_dkdv2 at 64; at 128 fa_back_wgmma_dkdv on Hopper, else fa_back_mma_dkdv), with
    GGML_CUDA_FA_BACK_WGMMA=0 (fa_back_mma_dkdv at 128 on Hopper too), dq, dk, dv within 1e-10 NMSE of the same
    kernels' in the heads-fastest order (dQ, and dK and dV of the query heads, added by atomics in whatever order
    the blocks reach them: F32 rounding, ~1e-14); with GGML_CUDA_FA_BACK_DETERMINISTIC=1 (no atomics: dQ summed by
    its own kernel, a block per K/V head writes its dK and dV) equal bit for bit: a block that decoded a wrong key
    block or head, or two blocks the same one, would write wrong or missing rows.
    test_gpu_flash_attention_gradients_match_cpu checks the default order's against the CPU."""
    base = {"default": {}, "mma": {"GGML_CUDA_FA_BACK_WGMMA": "0"}, "det": {"GGML_CUDA_FA_BACK_DETERMINISTIC": "1"}}
    envs = {
        f"{name}/{c or 'unset'}": {**env, "GGML_CUDA_FA_BACK_KB_CHUNK": c}
        for name, env in base.items()
        for c in ("0", "2", "auto", None)
    }
    grads, err = _cuda_runs(device, tmp_path, _FA_BACK_RUN, 6, envs, hopper=False)
    logged = {name: err[name].count("dK/dV blocks dispatched in chunks of") for name in envs}
    assert logged == {name: int(not name.endswith("/0")) for name in envs}, logged
    assert all("at head size 64 the heads fastest" in err[f"{name}/unset"] for name in base)
    for name in base:
        for c in ("2", "auto", "unset"):
            for i, (got, heads) in enumerate(zip(grads[f"{name}/{c}"], grads[f"{name}/0"])):
                what = name, c, ("dq", "dk", "dv")[i % 3], (64, 128)[i // 3]
                assert got.shape == heads.shape and np.isfinite(got).all(), what
                if name == "det":
                    np.testing.assert_array_equal(got, heads, err_msg=str(what))
                else:
                    assert ops.nmse(got, heads) < 1e-10, (what, ops.nmse(got, heads))


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("shape", [(600, 4100), (8, 4100), (3, 5001), (1, 49152), (2, 49153), (64, 49152)])
def test_gpu_argmax_reads_four_columns_a_load_and_keeps_the_last_maximum(device, shape):
    """Patch 0084 (CUDA): ggml_argmax reads rows of whole float4s four columns a load, other rows one a load
    ((3, 5001), (2, 49153)). Rows split over blocks where there are fewer than 2 x (the GPU's SMs) of them (patch
    0041: (8, 4100), (1, 49152), (64, 49152) on GPUs of 32 SMs and more), else one block a row ((600, 4100), as a
    training step's 8192 rows of logits). Of equal maxima the last column wins as on the CPU: ties inside one
    float4 (row 0), in two float4s of one thread's loads and of two threads (row 1), at a 2048-column chunk
    boundary (row -1)."""
    n = shape[1]
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    x[0, [100, 101, 102]] = 3.0  # one float4: columns 100..103
    if shape[0] > 1:
        x[1, [8, 13, 4 * 1024 + 1, n - 5]] = 2.5
        x[-1, [2047, 2048, n // 2]] = 2.75
    want = n - 1 - x[:, ::-1].argmax(-1)  # numpy's argmax takes the first: the last from the reversed row
    np.testing.assert_array_equal(ops.argmax(x, backend=device), want)


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize(
    "shape,axes",
    [((2, 3, 5, 8), (0, 2, 1, 3)), ((3, 7, 64), (1, 0, 2)), ((4, 5, 6), (2, 1, 0))],
    ids=["rows-of-8", "rows-of-64", "scalar"],
)
def test_gpu_permute_copies_exactly(device, shape, axes):
    """Patch 0057 (CUDA): a same-shape F32 copy whose rows stay contiguous and 16-byte aligned (the CONT of a
    permuted gradient in training) moves 4 floats a thread; a permute made contiguous on the device equals
    numpy's bit for bit. The last case moves the innermost axis: the scalar kernel."""
    x = f32(*shape)
    got = ops.permute(x, axes, backend=device)
    np.testing.assert_array_equal(got, np.ascontiguousarray(np.transpose(x, axes)))


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize(
    "small,big", [((96,), (3000, 96)), ((2, 1, 40), (2, 700, 40)), ((1, 5), (20000, 5)), ((3, 1), (6, 4000))], ids=str
)
def test_gpu_repeat_gradient_over_many_repeats(device, small, big):
    """Patch 0057 (CUDA): REPEAT_BACK, the gradient of a broadcast (a norm weight's, summed over the tokens),
    splits many repeats into chunks whose sums are added in a fixed order. Against float64: d/da sum(tile(a) *
    w) is w summed over the tiles. F32 sums of up to 20,000 terms: 1e-4 relative is ~100x their rounding."""
    a, w = f32(*small), f32(*big)
    try:
        got = ops.grad(lambda a: ops.sum(ops.mul(ops.repeat(a, big), w)), backend=device)(a)
    except TypeError as err:  # no REPEAT_BACK on the device (Metal at the pin): a clear error, never a crash
        pytest.skip(str(err))
    s = (1,) * (len(big) - len(small)) + small
    split = [n for b, k in zip(big, s) for n in (b // k, k)]  # numpy.tile: the copies are the outer blocks
    want = w.astype(np.float64).reshape(split).sum(axis=tuple(range(0, 2 * len(big), 2))).reshape(small)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("shape", [(64, 300), (7, 33)], ids=str)
def test_gpu_swiglu_gradients_match_cpu(device, shape):
    """Patch 0059 (CUDA): the four nodes of a split SwiGLU's backward (MUL, SILU_BACK, SILU, MUL) run as one
    kernel with the unfused kernels' arithmetic; the gradients of both inputs against the CPU's by NMSE
    (limit 1e-6: the same F32 formulas, the GPU's fast exp). (64, 300): four elements a thread (patch 0089);
    (7, 33), 231 elements: one a thread."""
    a, b, w = f32(*shape), f32(*shape), f32(*shape)

    def loss(a, b):
        return ops.sum(ops.mul(ops.swiglu(a, b), w))

    got = ops.grad(loss, argnums=(0, 1), backend=device)(a, b)
    want = ops.grad(loss, argnums=(0, 1), backend="cpu")(a, b)
    for name, g, r in zip("ab", got, want):
        assert ops.nmse(g, r) < 1e-6, f"d{name} on {device}: NMSE {ops.nmse(g, r):.3g}"


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("shape", [(37, 2048), (3, 5, 7, 512), (6, 64)], ids=str)
def test_gpu_rms_norm_times_a_weight_in_one_graph(device, shape):
    """Patch 0081 (CUDA): RMS_NORM followed by a MUL by a weight row in one graph, as every llama block has it
    (ggml-cuda fuses the two), a warp per row where rows are 128 * k floats up to 2048, upstream's kernel for rows of
    64; against float64. F32 sums of up to 2048 squares: 1e-10 NMSE is far above their rounding (~1e-14) and far
    below a wrong row, weight or scale."""
    x, w = f32(*shape), f32(shape[-1])
    with ops.graph(device) as g:
        y = ops.mul(ops.rms_norm(x, 1e-6), w)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6) * w.astype(np.float64)
    assert ops.nmse(g.compute(y), want) < 1e-10


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize(
    "shape", [(37, 2048), (3, 5, 128), (7, 576), (9, 66)], ids=["rows-2048", "rows-128", "rows-576", "rows-66"]
)
def test_gpu_rms_norm_back_of_a_weighted_output_plus_a_residual_in_one_graph(device, shape):
    """Patch 0083 (CUDA): a llama block's backward pass at its normed input in one graph: MUL of the output's
    gradient by the norm's weight, RMS_NORM_BACK at x, ADD of the residual's gradient; ggml-cuda runs the three as
    one pass over the rows where the row kernel takes them (rows of 4 * k floats up to 2048: 576 leaves part of a
    warp idle in a row's last chunk), else unfused (66).
    Against float64: dx = (dy*w - x*mean(x*dy*w)/(mean(x^2)+eps))/sqrt(mean(x^2)+eps) + g; 1e-10 NMSE as the
    forward's test (F32 sums of up to 2048 products)."""
    dy, x, g, w = f32(*shape), f32(*shape), f32(*shape), f32(shape[-1])
    with ops.graph(device) as gr:
        y = ops.add(g, ops.rms_norm_back(ops.mul(dy, w), x, 1e-6))
    d64, x64 = dy.astype(np.float64) * w.astype(np.float64), x.astype(np.float64)
    ms = (x64**2).mean(-1, keepdims=True) + 1e-6
    want = (d64 - x64 * (x64 * d64).mean(-1, keepdims=True) / ms) / np.sqrt(ms) + g.astype(np.float64)
    assert ops.nmse(gr.compute(y), want) < 1e-10


@pytest.mark.parametrize("device", GPUS)
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "output-norm"])
@pytest.mark.parametrize(
    "shape", [(37, 2048), (3000, 256), (3, 5, 128), (7, 576), (9, 66)], ids=lambda s: "x".join(map(str, s))
)
def test_gpu_gradient_of_a_trained_rms_norm_weight_in_one_pass(device, residual, shape):
    """Patch 0086 (CUDA): the gradients of y = x + rms_norm(x)*w (residual) and of y = rms_norm(x)*w (a model's output
    norm) at x and at the weight w, by ggml's backward graph (ops.grad): MUL (dy*w), MUL (xn*dy), REPEAT_BACK (dw),
    RMS_NORM_BACK and, with the residual, the ADD of x's two gradients, as a full fine-tune has them at every norm.
    ggml-cuda runs them as one pass over the rows and a sum of the blocks' column sums where the row kernel takes
    the rows (4 * k floats up to 2048; 3000 rows: the blocks stride over several rows each), else unfused (66).
    Against float64 for a random cotangent c of y: dx = c (residual) + (c*w - x*mean(x*c*w)/ms)/sqrt(ms), ms =
    mean(x^2) + eps, and dw = the sum over every row of c*x/sqrt(ms). 1e-10 NMSE, as the forward's test (F32 sums
    of up to 3000 products, ~1e-13 here)."""
    x, w, c = f32(*shape), f32(shape[-1]), f32(*shape)

    def f(x, w):
        y = ops.mul(ops.rms_norm(x, 1e-6), w)
        return ops.sum(ops.mul(ops.add(x, y) if residual else y, c))

    dx, dw = ops.grad(f, argnums=(0, 1), backend=device)(x, w)
    x64, c64, w64 = x.astype(np.float64), c.astype(np.float64), w.astype(np.float64)
    ms = (x64**2).mean(-1, keepdims=True) + 1e-6
    g = c64 * w64
    want_dx = (g - x64 * (x64 * g).mean(-1, keepdims=True) / ms) / np.sqrt(ms) + (c64 if residual else 0)
    want_dw = (c64 * x64 / np.sqrt(ms)).reshape(-1, shape[-1]).sum(0)
    assert ops.nmse(dx, want_dx) < 1e-10
    assert ops.nmse(dw, want_dw) < 1e-10


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


# ---- arrays that stay on the device (issue 21)


@pytest.mark.parametrize("device", GPUS)
def test_device_arrays_chain_on_the_gpu_without_host_copies(device):
    x, b = f32(64, 128), f32(64, 128)
    dx, db = ops.to_device(x, device), ops.to_device(b, device)
    assert dx.device == device and dx.shape == x.shape
    ops.clear_cache()
    y = ops.add(dx, db)
    (exe, _, _), *rest = eager._cache.values()
    assert not rest and exe.graph._ggml_graph.bytes_copied == 0  # bound to the device buffers in place
    y = ops.soft_max(ops.rms_norm(ops.silu(ops.mul(y, db))))
    assert isinstance(y, ops.DeviceArray) and y.device == device
    ref = ops.soft_max(ops.rms_norm(ops.silu(ops.mul(ops.add(x, b), b))))  # the same ops on the CPU
    assert ops.nmse(y.numpy(), ref) < 1e-7
    with pytest.raises(ValueError, match="not on the op's device"):
        ops.add(dx, dx, backend="cpu")


@pytest.mark.parametrize("device", [d for d in GPUS if d.startswith("CUDA")] or ["none"])
def test_dlpack_with_torch_on_cuda(device):
    torch = pytest.importorskip("torch")
    if device == "none" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA device in llamabind and in torch")
    t = torch.randn(32, 64, device=f"cuda:{int(device[4:])}")
    d = ops.from_dlpack(t)  # shares t's memory
    assert d.device == device and d.shape == (32, 64)
    r = ops.silu(d)
    tr = torch.from_dlpack(r)  # shares r's memory
    assert tr.device == t.device
    torch.testing.assert_close(tr, torch.nn.functional.silu(t), rtol=1e-5, atol=1e-6)
    t[0, 0] = 5.0
    torch.cuda.synchronize()
    assert d.numpy()[0, 0] == 5.0
    r2 = ops.add(t, t, backend=device)  # torch tensors as op arguments: imported, not copied
    assert isinstance(r2, ops.DeviceArray)
    torch.testing.assert_close(torch.from_dlpack(r2), t + t)
