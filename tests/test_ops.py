"""llamabind.ops forward: every op against a numpy float64 reference, on the CPU backend."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from conftest import TEST_BACKEND

from llamabind import ops

BF16 = np.dtype(ml_dtypes.bfloat16)
F32, F16 = np.dtype(np.float32), np.dtype(np.float16)
# tolerance (rtol = atol) by dtype: float32 vs float64 math, half precisions by their mantissas
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1.6e-2}
# On a GPU (LLAMABIND_TEST_BACKEND=cuda, see conftest) float32 is not computed to these bounds:
# cuBLAS runs float32 mat-mul in TF32 (10-bit mantissa) and the kernels use fast sin/cos/exp. There
# the floor is 2e-3, and every op call is also compared with the CPU backend by NMSE (conftest).
GPU_RUN = TEST_BACKEND not in (None, "cpu")
GPU_TOL = 2e-3


def rnd(*shape, dtype=np.float32, lo=-2.0, hi=2.0, seed=None):
    rng = np.random.default_rng(seed if seed is not None else hash((shape, str(dtype))) % 2**32)
    x = rng.uniform(lo, hi, size=shape)
    x[np.abs(x) < 1e-3] = 0.5  # fresh random inputs, never (near) zeros
    return x.astype(dtype)


def close(out, ref, dtype=F32, tol=None):
    t = TOL[np.dtype(dtype)] if tol is None else tol
    atol = t
    if GPU_RUN:
        # TF32 mat-mul rounds each product to ~1e-3 of its size: an element that is a near-cancelling
        # sum of large terms (seen: -0.30 out of terms ~20, off by 4e-3 on an H200) needs an absolute
        # tolerance on the scale of the result, not of that element
        t = max(t, GPU_TOL)
        atol = t * max(1.0, float(np.max(np.abs(ref))) if np.size(ref) else 1.0)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=t, atol=atol)


def f64(x):
    return np.asarray(x, np.float64)


# ---- element-wise

BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}


@pytest.mark.parametrize("name", list(BINARY))
@pytest.mark.parametrize("dt", [(F32, F32), (F16, F16), (BF16, BF16), (F16, F32), (BF16, F32)], ids=str)
@pytest.mark.parametrize(
    "shapes", [((3, 5), (3, 5)), ((2, 3, 4), (4,)), ((2, 3, 4), (3, 1)), ((1, 4), (3, 4)), ((2, 1, 3, 4), (2, 5, 1, 4))]
)
def test_binary(name, dt, shapes):
    a = rnd(*shapes[0], dtype=dt[0])
    b = rnd(*shapes[1], dtype=dt[1], lo=0.5, hi=2.0)  # positive: no division by ~0
    out = getattr(ops, name)(a, b)
    ref = BINARY[name](f64(a), f64(b))
    assert out.shape == ref.shape and out.dtype == a.dtype
    close(out, ref, dt[0], tol=TOL[dt[0]] * (4 if name == "div" else 1))


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


UNARY = {
    "sqr": (np.square, -2, 2),
    "sqrt": (np.sqrt, 0.1, 4),
    "exp": (np.exp, -2, 2),
    "log": (np.log, 0.1, 4),
    "abs": (np.abs, -2, 2),
    "neg": (np.negative, -2, 2),
    "silu": (lambda x: x / (1 + np.exp(-x)), -4, 4),
    "gelu": (_gelu, -4, 4),
    "relu": (lambda x: np.maximum(x, 0), -2, 2),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), -4, 4),
    "tanh": (np.tanh, -3, 3),
}


@pytest.mark.parametrize("name", list(UNARY))
@pytest.mark.parametrize("dt", [F32, F16, BF16], ids=str)
def test_unary(name, dt):
    fn, lo, hi = UNARY[name]
    x = rnd(4, 33, dtype=dt, lo=lo, hi=hi)
    out = getattr(ops, name)(x)
    assert out.shape == x.shape and out.dtype == dt
    # ggml's CPU gelu uses a float16 lookup table for float32 too
    close(out, fn(f64(x)), dt, tol=max(TOL[dt], 2e-3) if name == "gelu" else TOL[dt] * 2)


def test_scale_clamp_silu_back():
    x = rnd(3, 17)
    close(ops.scale(x, -1.5), -1.5 * f64(x))
    close(ops.scale(x.astype(BF16), 0.5), 0.5 * f64(x.astype(BF16)), BF16)
    close(ops.clamp(x, -0.5, 0.25), np.clip(f64(x), -0.5, 0.25))
    dy = rnd(3, 17, seed=3)
    s = 1 / (1 + np.exp(-f64(x)))
    close(ops.silu_back(dy, x), f64(dy) * s * (1 + f64(x) * (1 - s)))


@pytest.mark.parametrize("dt", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_swiglu(dt):
    a, b = rnd(5, 24, dtype=dt), rnd(5, 24, dtype=dt, seed=7)
    out = ops.swiglu(a, b)
    assert out.shape == a.shape and out.dtype == dt
    close(out, f64(a) / (1 + np.exp(-f64(a))) * f64(b), dt)
    with pytest.raises(ValueError, match="same shape"):
        ops.swiglu(a, b[:, :3])


# ---- reductions and products


def test_reductions():
    x = rnd(3, 4, 50)
    close(ops.sum(x), f64(x).sum(), tol=1e-4)
    assert ops.sum(x).shape == ()
    close(ops.sum_rows(x), f64(x).sum(-1, keepdims=True), tol=1e-5)
    close(ops.mean(x), f64(x).mean(-1, keepdims=True))
    m = rnd(6, 40)
    np.testing.assert_array_equal(ops.argmax(m), m.argmax(-1))
    assert ops.argmax(m).dtype == np.int32
    assert ops.argmax(m[0]).shape == () and int(ops.argmax(m[0])) == m[0].argmax()


@pytest.mark.parametrize("shape", [(1, 49152), (3, 128256), (200, 4100), (2, 5000)])
def test_argmax_of_long_rows_and_ties_takes_the_last_maximum(shape):
    """ggml_argmax of a decode's logits (one row of n_vocab per sequence; on CUDA, patch 0041 splits a
    few long rows over several blocks) and of many rows (one block each). Of equal maxima the last
    column wins, as ggml's CPU kernel (ggml_vec_argmax_f32) has it: here ties within a block's columns,
    across the blocks' boundaries and across the whole row, and a row of -inf (its last column)."""
    x = rnd(*shape, seed=shape[1])
    n = shape[1]
    x[0, [5, n // 3, n // 2 + 1, n - 7]] = 3.0  # one maximum in several places of row 0
    if shape[0] > 1:
        x[1, [2047, 2048, 4095]] = 2.5  # around a 2048-column boundary
        x[-1] = -np.inf
    want = n - 1 - x[:, ::-1].argmax(-1)  # numpy's argmax takes the first: the last from the reversed row
    np.testing.assert_array_equal(ops.argmax(x), want)


@pytest.mark.parametrize(
    "sa,sb",
    [
        ((3, 4), (4, 5)),
        ((2, 3, 4), (2, 4, 6)),
        ((2, 3, 4), (4, 6)),
        ((3, 4), (2, 4, 6)),
        ((2, 2, 3, 4), (2, 1, 4, 5)),
        ((4,), (4, 3)),
        ((3, 4), (4,)),
        ((7,), (7,)),
    ],
)
def test_mul_mat_is_numpy_matmul(sa, sb):
    a, b = rnd(*sa), rnd(*sb, seed=9)
    out = ops.mul_mat(a, b)
    ref = f64(a) @ f64(b)
    assert out.shape == ref.shape and out.dtype == np.float32
    close(out, ref, tol=1e-5)


@pytest.mark.parametrize("da,db", [(F16, F16), (F32, F16), (BF16, BF16), (F32, BF16), (BF16, F32)], ids=str)
def test_mul_mat_half_types(da, db):
    """ggml rounds an F32 factor to the other's half type and sums the products in F32: each product is off
    by at most 2u + u^2 of its size (u: the half type's unit roundoff, 2^-11 for float16, 2^-8 for bfloat16),
    so each element is within (2u + u^2) sum_k |a_ik b_kj| (+ the F32 sum's rounding) of the float64 product.
    (The inputs used to come from a str hash, which changes per process: a tolerance of 0.05 failed on a
    near-cancelling element of some draws.)"""
    a, b = rnd(8, 64, dtype=da, seed=1), rnd(64, 16, dtype=db, seed=2)
    out = np.asarray(ops.mul_mat(a, b), np.float64)
    u = 2.0**-8 if BF16 in (da, db) else 2.0**-11
    scale = np.abs(f64(a)) @ np.abs(f64(b))
    bound = (2 * u + u * u) * scale + 64 * 2.0**-23 * scale + 1e-6
    if GPU_RUN:  # a GPU may sum in another order or in TF32 (close()'s tolerance on the result's scale)
        bound = np.maximum(bound, GPU_TOL * float(scale.max()))
    err = np.abs(out - f64(a) @ f64(b))
    assert np.all(err <= bound), f"max error / bound {float((err / bound).max()):.3g}"


def test_out_prod():
    a, b = rnd(5, 3), rnd(5, 4, seed=1)
    close(ops.out_prod(a, b), f64(a).T @ f64(b))
    close(ops.out_prod(a[0], b[0]), np.outer(f64(a[0]), f64(b[0])))


# ---- normalization and softmax


def test_norms():
    x = rnd(3, 5, 64)
    e = 1e-5
    mu, var = f64(x).mean(-1, keepdims=True), f64(x).var(-1, keepdims=True)
    close(ops.norm(x, e), (f64(x) - mu) / np.sqrt(var + e), tol=1e-4)
    close(ops.rms_norm(x, e), f64(x) / np.sqrt((f64(x) ** 2).mean(-1, keepdims=True) + e), tol=1e-4)
    close(ops.l2_norm(x, 1e-12), f64(x) / np.linalg.norm(f64(x), axis=-1, keepdims=True))
    img = rnd(2, 6, 4, 5)
    ref = f64(img).reshape(2, 3, -1)
    ref = ((ref - ref.mean(-1, keepdims=True)) / np.sqrt(ref.var(-1, keepdims=True) + 1e-6)).reshape(img.shape)
    close(ops.group_norm(img, 3, 1e-6), ref, tol=1e-4)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _log_softmax(x):
    """float64 log-softmax over the last axis (shifted by the row's max, as ggml's)."""
    z = f64(x) - f64(x).max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_soft_max():
    x = rnd(2, 3, 5, 7)
    close(ops.soft_max(x), _softmax(f64(x)))
    close(ops.soft_max(x, scale=0.3), _softmax(0.3 * f64(x)))
    mask = np.triu(np.full((5, 7), -np.inf), 3).astype(np.float32)
    close(ops.soft_max(x, mask, scale=0.5), _softmax(0.5 * f64(x) + mask))
    close(ops.soft_max(x, mask.astype(np.float16)), _softmax(f64(x) + mask))
    # ALiBi: head h gets slope m_h = 2^(-8 (h+1) / n_head) for n_head a power of two
    xh = rnd(4, 3, 6, seed=5)
    mask2 = rnd(3, 6, seed=6)
    slopes = 2.0 ** (-8.0 * np.arange(1, 5) / 4)
    close(ops.soft_max(xh, mask2, max_bias=8.0), _softmax(f64(xh) + slopes[:, None, None] * f64(mask2)))


def test_soft_max_back_and_rms_norm_back_values():
    y = _softmax(f64(rnd(3, 9))).astype(np.float32)
    dy = rnd(3, 9, seed=4)
    close(ops.soft_max_back(dy, y, 2.0), 2.0 * f64(y) * (f64(dy) - (f64(y) * f64(dy)).sum(-1, keepdims=True)))


def test_cross_entropy_loss_and_its_gradient_values():
    """ggml_cross_entropy_loss: -sum(labels * log_softmax(logits)) / rows, one-hot and soft labels, rows
    over two leading axes; ggml_cross_entropy_loss_back: (softmax(logits) - labels) * grad / rows."""
    logits = rnd(2, 3, 40, lo=-6.0, hi=6.0)
    onehot = np.eye(40, dtype=np.float32)[np.arange(6).reshape(2, 3) * 7 % 40]
    soft = _softmax(f64(rnd(2, 3, 40, seed=3))).astype(np.float32)
    logp = _log_softmax(logits)
    for labels in (onehot, soft):
        close(ops.cross_entropy_loss(logits, labels), -(f64(labels) * logp).sum() / 6)
        g = np.array([1.5], np.float32)
        close(ops.cross_entropy_loss_back(g, logits, labels), (np.exp(logp) - f64(labels)) * 1.5 / 6)
    with pytest.raises(ValueError, match="one shape"):
        ops.cross_entropy_loss(logits, onehot[:, :2])


def test_cross_entropy_loss_takes_the_class_of_each_row():
    """Patch 0090: ggml_cross_entropy_loss(_back) with labels as the class of each row (int32 of shape
    logits.shape[:-1], ggml's I32 [1, rows]) against float64, rows over two leading axes and a row length not a
    multiple of 4; the same values as the one-hot rows of those classes (the backward's bits on the CPU: the class
    form subtracts 1 from one element where the dense form subtracts a row of 0s and one 1; where a backend runs the
    one-hot form and leaves the class form to the CPU, Vulkan's, the two softmax kernels agree to 1e-5), a class outside
    [0, classes) as a row of zeros; labels of other shapes or dtypes raise before ggml sees them."""
    logits = rnd(2, 3, 41, lo=-6.0, hi=6.0)
    classes = (np.arange(6).reshape(2, 3) * 7 % 41).astype(np.int32)
    classes[1, 2] = 40  # the last class (a row's tail past the last multiple of 4)
    onehot = np.eye(41, dtype=np.float32)[classes]
    logp = _log_softmax(logits)
    g = np.array([1.5], np.float32)
    close(ops.cross_entropy_loss(logits, classes), -(f64(onehot) * logp).sum() / 6)
    close(ops.cross_entropy_loss_back(g, logits, classes), (np.exp(logp) - f64(onehot)) * 1.5 / 6)
    loss, loss_dense = ops.cross_entropy_loss(logits, classes), ops.cross_entropy_loss(logits, onehot)
    np.testing.assert_allclose(loss, loss_dense, rtol=1e-6)
    back, back_dense = ops.cross_entropy_loss_back(g, logits, classes), ops.cross_entropy_loss_back(g, logits, onehot)
    if TEST_BACKEND in (None, "cpu"):
        np.testing.assert_array_equal(back, back_dense)
    else:  # Vulkan0 runs the one-hot form and leaves the class form to the CPU: two softmax kernels, ~1e-6 apart
        np.testing.assert_allclose(back, back_dense, rtol=1e-5, atol=1e-12)
    outside = classes.copy()
    outside[0, 1], outside[1, 0] = -1, 41
    zeros = onehot.copy()
    zeros[0, 1] = zeros[1, 0] = 0.0
    close(ops.cross_entropy_loss(logits, outside), -(f64(zeros) * logp).sum() / 6)
    close(ops.cross_entropy_loss_back(g, logits, outside), (np.exp(logp) - f64(zeros)) * 1.5 / 6)
    with pytest.raises(ValueError, match=r"logits.shape\[:-1\]"):
        ops.cross_entropy_loss(logits, classes[:, :2])
    with pytest.raises(ValueError, match=r"logits.shape\[:-1\]"):
        ops.cross_entropy_loss_back(g, logits, classes[..., None])
    with pytest.raises(TypeError, match="int64"):
        ops.cross_entropy_loss(logits, classes.astype(np.int64))


@pytest.mark.parametrize("n", [7, 16, 17, 33, 576, 2049])
def test_rms_norm_and_its_backward_over_long_rows_against_float64(n):
    """Patch 0073 (CPU): RMS_NORM and RMS_NORM_BACK sum x*x and x*dz in two SIMD vectors of double partial sums
    (16 / 8 / 4 terms a step), the row's rest one at a time: rows of 7 to 2049 columns (SmolLM2's 576 among them)
    cover both and a row of values ~1e15 the range. Against float64: rms_norm(x) = x / sqrt(mean(x^2) + eps) and
    its gradient r * (dz - x * sum(x*dz) / (sum(x^2) + n*eps)), r = 1/sqrt(mean(x^2) + eps), to 1e-5 relative
    (float products and outputs; where the gradient's two terms cancel, 1e-6 of the row's largest; a sum missing
    any vector's terms is off by far more)."""
    rng = np.random.default_rng(n)
    x = rng.uniform(-3, 3, size=(5, n)).astype(np.float32)
    x[1] *= 1e15
    x[2, n // 2 :] = 0.0  # the sum's terms in one half of the row only
    dz = rng.uniform(-2, 2, size=(5, n)).astype(np.float32)
    eps = 1e-6
    xd, dzd = f64(x), f64(dz)
    ss = (xd * xd).sum(-1, keepdims=True)
    r = 1 / np.sqrt(ss / n + eps)
    np.testing.assert_allclose(ops.rms_norm(x, eps), xd * r, rtol=1e-5, atol=1e-6)
    want = r * (dzd - xd * (xd * dzd).sum(-1, keepdims=True) / (ss + n * eps))
    got = ops.rms_norm_back(dz, x, eps)
    # 1e-5 relative, or 1e-6 of the row's largest gradient where dz and x*c cancel (F32's few ulps of the terms)
    err = np.abs(got - want) / (np.abs(want) + 0.1 * np.abs(want).max(-1, keepdims=True))
    assert err.max() < 1e-5, err.max()


@pytest.mark.parametrize("n", [7, 17, 33, 64, 257])
def test_silu_back_and_soft_max_over_long_rows_against_float64(n):
    """Patch 0072 (CPU): SILU_BACK computes silu's derivative 16/8/4 at a time through ggml_v_expf and the softmax's
    row maximum takes SIMD maxima, each row's remainder as before: rows of 7 to 257 columns cover the vector loops
    and their tails. silu_back against float64 to F32 rounding (rtol 1e-5: ggml_v_expf is within a few ulps),
    exactly 0 and exactly dy where e^-x overflows or vanishes. Each softmax row's maximum sits at another column
    (the first, a vector's last lane, the second accumulator's lanes, the remainder), at least 100 above the row's
    other scaled logits: the maximum of any other columns would overflow the largest exp (e^100 > FLT_MAX), so
    the float64 comparison checks the maximum too."""
    rng = np.random.default_rng(n)
    x = rng.uniform(-12, 12, size=(6, n)).astype(np.float32)
    x[0, : min(n, 4)] = [-100.0, 100.0, -88.5, 0.0][: min(n, 4)]
    dy = rng.uniform(-2, 2, size=(6, n)).astype(np.float32)
    s = 1 / (1 + np.exp(-f64(x)))
    want = f64(dy) * s * (1 + f64(x) * (1 - s))
    got = ops.silu_back(dy, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max())
    if n >= 2:
        assert got[0, 0] == 0.0 and got[0, 1] == dy[0, 1]

    logits = rng.uniform(-2000, 600, size=(8, n)).astype(np.float32)
    at = [max(c, 0) for c in (0, n - 1, n // 2, min(15, n - 1), min(16, n - 1), min(31, n - 1), min(32, n - 1), n - 2)]
    logits[np.arange(8), at] = 800.0
    mask = np.zeros((8, n), np.float32)
    mask[:, 1::3] = -np.inf
    mask[np.arange(8), at] = 0
    out = ops.soft_max(logits, mask, scale=0.5)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, _softmax(f64(logits) * 0.5 + f64(mask)), rtol=1e-5, atol=1e-7)


def test_cross_entropy_loss_over_a_real_vocabulary():
    """Patch 0071's vectorized log-softmax (ggml_v_expf, 16 or 8 lanes and a scalar tail) at SmolLM2's 49,152
    and an odd 32,001 columns, logits of a trained model's spread (|x| up to 30), against float64: within F32's
    rounding of a sum over the row (rtol 1e-5 of the loss)."""
    rng = np.random.default_rng(7)
    for n in (49152, 32001):
        logits = (rng.standard_normal((4, n)) * 6.0).clip(-30, 30).astype(np.float32)
        labels = np.eye(n, dtype=np.float32)[rng.integers(0, n, 4)]
        want = -(f64(labels) * _log_softmax(logits)).sum() / 4
        got = float(np.asarray(ops.cross_entropy_loss(logits, labels)).reshape(-1)[0])
        assert abs(got - want) <= 1e-5 * abs(want), (n, got, want)


# ---- rope


def rope_ref(x, pos, n_dims, mode, base=10000.0, freq_scale=1.0):
    """Reference RoPE (no YaRN): x (..., n_tokens, n_head, head_dim), float64."""
    x = f64(x).copy()
    theta = freq_scale * pos[:, None] * base ** (-np.arange(0, n_dims, 2) / n_dims)  # (n_tokens, n_dims/2)
    c, s = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    if mode == "normal":
        x0, x1 = x[..., 0:n_dims:2].copy(), x[..., 1:n_dims:2].copy()
        x[..., 0:n_dims:2], x[..., 1:n_dims:2] = x0 * c - x1 * s, x0 * s + x1 * c
    else:
        h = n_dims // 2
        x0, x1 = x[..., :h].copy(), x[..., h:n_dims].copy()
        x[..., :h], x[..., h:n_dims] = x0 * c - x1 * s, x0 * s + x1 * c
    return x


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("n_dims", [8, 16])
def test_rope(mode, n_dims):
    x = rnd(5, 3, 16)
    pos = np.array([0, 3, 7, 100, 1000], np.int32)
    close(ops.rope(x, pos, n_dims, mode), rope_ref(x, pos, n_dims, mode), tol=1e-4)
    close(
        ops.rope(x, pos, n_dims, mode, freq_base=500.0, freq_scale=0.25),
        rope_ref(x, pos, n_dims, mode, 500.0, 0.25),
        tol=1e-4,
    )
    xb = rnd(2, 5, 3, 16, seed=8)
    close(ops.rope(xb, pos, n_dims, mode), rope_ref(xb, pos, n_dims, mode), tol=1e-4)
    close(ops.rope(x.astype(np.float16), pos, n_dims, mode), rope_ref(x.astype(np.float16), pos, n_dims, mode), F16)


def test_rope_multi_and_yarn_run():
    x = rnd(4, 2, 32)
    pos = np.arange(16, dtype=np.int32)
    out = ops.rope(x, pos, 32, "mrope", sections=[4, 6, 6, 0])
    assert out.shape == x.shape and np.isfinite(out).all()
    # mrope with every position axis equal to the token position is neox rope on the rotated dims
    p4 = np.tile(np.arange(4, dtype=np.int32), 4)
    close(ops.rope(x, p4, 32, "mrope", sections=[16, 0, 0, 0]), rope_ref(x, np.arange(4), 32, "neox"), tol=1e-4)
    y = ops.rope(x, pos[:4], 32, "neox", n_ctx_orig=4096, ext_factor=1.0, freq_scale=0.25)
    assert np.isfinite(y).all() and not np.allclose(y, ops.rope(x, pos[:4], 32, "neox", freq_scale=0.25))


# ---- shape and data movement


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.int8, np.int16, np.int32, np.int64], ids=str)
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_concat_every_dtype_and_axis(dtype, axis):
    rng = np.random.default_rng(1)
    a = rng.integers(-100, 100, size=(2, 3, 4)).astype(dtype)
    bshape = [2, 3, 4]
    bshape[axis] = 5
    b = rng.integers(-100, 100, size=bshape).astype(dtype)
    out = ops.concat(a, b, axis)
    ref = np.concatenate([a, b], axis)
    assert out.dtype == ref.dtype
    np.testing.assert_array_equal(out.view(np.uint8), ref.view(np.uint8))  # exact, bit for bit


def test_get_rows_set_rows():
    a = rnd(10, 6)
    idx = np.array([3, 0, 9, 3], np.int32)
    np.testing.assert_array_equal(ops.get_rows(a, idx), a[idx])
    np.testing.assert_array_equal(ops.get_rows(a.astype(np.float16), idx), a.astype(np.float16)[idx].astype(np.float32))
    a3 = rnd(2, 10, 6)
    i3 = np.array([[1, 2], [9, 0]], np.int32)
    np.testing.assert_array_equal(ops.get_rows(a3, i3), np.stack([a3[0][i3[0]], a3[1][i3[1]]]))
    src = rnd(2, 6, seed=3)
    for it in (np.int64, np.int32):
        ref = a.copy()
        ref[[7, 2]] = src
        np.testing.assert_array_equal(ops.set_rows(a, np.array([7, 2], it), src), ref)


@pytest.mark.parametrize("to", [np.float16, BF16, np.float32], ids=str)
def test_cast(to):
    x = rnd(4, 9)
    np.testing.assert_array_equal(ops.cast(x, to).view(np.uint8), x.astype(to).view(np.uint8))
    i = np.arange(-5, 5, dtype=np.int32)
    np.testing.assert_array_equal(ops.cast(i, np.float32), i.astype(np.float32))
    f = i.astype(np.float32) + 0.25
    np.testing.assert_array_equal(ops.cast(f, np.int32), f.astype(np.int32))  # truncation toward zero


def test_views_reshape_repeat_pad():
    x = rnd(2, 3, 4, 5)
    np.testing.assert_array_equal(ops.transpose(x), np.swapaxes(x, -1, -2))
    for axes in [(0, 1, 3, 2), (3, 2, 1, 0), (1, 0, 2, 3), (2, 0, 3, 1)]:
        np.testing.assert_array_equal(ops.permute(x, axes), np.transpose(x, axes))
    np.testing.assert_array_equal(ops.permute(x[0], (2, 0, 1)), np.transpose(x[0], (2, 0, 1)))
    np.testing.assert_array_equal(ops.reshape(x, (6, -1)), x.reshape(6, -1))
    np.testing.assert_array_equal(ops.cont(x), x)
    np.testing.assert_array_equal(ops.repeat(x[0, :1], (2, 3, 8, 5)), np.tile(x[0, :1], (2, 3, 2, 1)))
    np.testing.assert_array_equal(ops.pad(x[0], ((1, 0), (0, 2), (3, 1))), np.pad(x[0], ((1, 0), (0, 2), (3, 1))))


# ---- convolution, pooling, upscale


def conv1d_ref(k, x, s=1, p=0, d=1):
    oc, ic, kk = k.shape
    xp = np.pad(f64(x), ((0, 0), (0, 0), (p, p)))
    ol = (x.shape[-1] + 2 * p - d * (kk - 1) - 1) // s + 1
    out = np.zeros((x.shape[0], oc, ol))
    for o in range(ol):
        win = xp[:, :, o * s : o * s + d * (kk - 1) + 1 : d]  # (N, IC, K)
        out[:, :, o] = np.einsum("nik,oik->no", win, f64(k))
    return out


def im2col1d_ref(kshape, x, s=1, p=0, d=1):
    oc, ic, kk = kshape
    xp = np.pad(f64(x), ((0, 0), (0, 0), (p, p)))
    ol = (x.shape[-1] + 2 * p - d * (kk - 1) - 1) // s + 1
    return np.stack([xp[:, :, o * s : o * s + d * (kk - 1) + 1 : d].reshape(x.shape[0], -1) for o in range(ol)], 1)


def test_conv_1d_and_im2col():
    k, x = rnd(4, 3, 5), rnd(2, 3, 20, seed=1)
    for s, p, d in [(1, 0, 1), (2, 1, 1), (1, 2, 2)]:
        close(ops.conv_1d(k, x, s, p, d), conv1d_ref(k, x, s, p, d), tol=2e-2)  # im2col in float16
        close(ops.im2col(k, x, s, p, d), im2col1d_ref(k.shape, x, s, p, d))
    close(ops.conv_1d(k, x[0]), conv1d_ref(k, x[:1])[0], tol=2e-2)


def test_im2col_conv_1d_kw3_ic512_long_sequence():
    """Upstream fix PR #24220 (b9555): KW*IC > 1024 >= KW, whisper's encoder conv (KW=3, IC=512)."""
    k, x = rnd(8, 512, 3), rnd(1, 512, 600, seed=2)
    close(ops.im2col(k, x, 1, 1, 1), im2col1d_ref(k.shape, x, 1, 1, 1))
    close(ops.conv_1d(k, x, 1, 1, 1), conv1d_ref(k, x, 1, 1, 1), tol=0.15)  # 1536-term float16 dot products


def test_conv_2d_and_im2col_2d():
    k, x = rnd(4, 3, 3, 2), rnd(2, 3, 7, 6, seed=1)
    out = ops.conv_2d(k, x, stride=(2, 1), padding=(1, 0))
    xp = np.pad(f64(x), ((0, 0), (0, 0), (1, 1), (0, 0)))
    oh, ow = (7 + 2 - 3) // 2 + 1, (6 - 2) // 1 + 1
    ref = np.zeros((2, 4, oh, ow))
    cols = np.zeros((2, oh, ow, 3 * 3 * 2))
    for i in range(oh):
        for j in range(ow):
            win = xp[:, :, i * 2 : i * 2 + 3, j : j + 2]
            ref[:, :, i, j] = np.einsum("nchw,ochw->no", win, f64(k))
            cols[:, i, j] = win.reshape(2, -1)
    close(out, ref, tol=2e-2)
    close(ops.im2col(k, x, stride=(2, 1), padding=(1, 0)), cols)


def test_conv_transpose_1d():
    k, x = rnd(3, 2, 4), rnd(3, 6, seed=1)
    for s in (1, 2, 3):
        out = ops.conv_transpose_1d(k, x, s)
        ref = np.zeros((2, (6 - 1) * s + 4))
        for i in range(6):
            ref[:, i * s : i * s + 4] += np.einsum("c,cok->ok", f64(x[:, i]), f64(k))
        close(out, ref, tol=1e-4)


def test_pooling():
    x = rnd(2, 3, 12)
    close(ops.pool_1d(x, "max", 3), f64(x).reshape(2, 3, 4, 3).max(-1))
    close(ops.pool_1d(x, "avg", 2), f64(x).reshape(2, 3, 6, 2).mean(-1))
    img = rnd(2, 6, 8)
    close(ops.pool_2d(img, "max", 2), f64(img).reshape(2, 3, 2, 4, 2).max((2, 4)))
    close(ops.pool_2d(img, "avg", (3, 2)), f64(img).reshape(2, 2, 3, 4, 2).mean((2, 4)))


def test_upscale():
    x = rnd(1, 2, 3, 4)
    close(ops.upscale(x, scale_factor=2), np.repeat(np.repeat(f64(x), 2, -1), 2, -2))
    out = ops.upscale(x, size=(5, 7), mode="bilinear", align_corners=True)
    assert out.shape == (1, 2, 5, 7)
    close(out[..., 0, 0], f64(x)[..., 0, 0])  # corners are kept with align_corners
    close(out[..., -1, -1], f64(x)[..., -1, -1])


# ---- generators, sorting, attention


def test_arange_timestep_argsort_top_k():
    close(ops.arange(0.5, 10.0, 1.5), np.arange(0.5, 10.0, 1.5))
    t = np.array([1.0, 10.0, 500.0], np.float32)
    half = 8
    freqs = np.exp(-math.log(10000) * np.arange(half) / half)
    ref = np.concatenate([np.cos(f64(t)[:, None] * freqs), np.sin(f64(t)[:, None] * freqs)], -1)
    close(ops.timestep_embedding(t, 16), ref, tol=1e-4)
    x = rnd(4, 33)
    np.testing.assert_array_equal(ops.argsort(x), np.argsort(x, -1, kind="stable"))
    np.testing.assert_array_equal(ops.argsort(x, descending=True), np.argsort(-x, -1, kind="stable"))
    tk = ops.top_k(x, 5)
    assert tk.shape == (4, 5)
    for r in range(4):
        assert set(tk[r].tolist()) == set(np.argsort(-x[r])[:5].tolist())


def test_flash_attn_ext():
    q = rnd(1, 4, 5, 16)
    k = rnd(1, 2, 9, 16, seed=1).astype(np.float16)
    v = rnd(1, 2, 9, 8, seed=2).astype(np.float16)
    mask = np.where(np.arange(9)[None, :] <= np.arange(5)[:, None] + 4, 0, -np.inf).astype(np.float16)
    out = ops.flash_attn_ext(q, k, v, mask)
    kk, vv = np.repeat(f64(k), 2, 1), np.repeat(f64(v), 2, 1)  # grouped-query: 2 q heads per kv head
    s = f64(q) @ np.swapaxes(kk, -1, -2) / 4.0 + f64(mask)
    ref = _softmax(s) @ vv
    assert out.shape == (1, 4, 5, 8)
    close(out, ref, tol=5e-3)  # q is rounded to float16 for the f16 K/V dot products


# ---- quantization


@pytest.mark.parametrize("qtype,tol", [("q8_0", 0.01), ("q4_0", 0.15), ("q4_1", 0.1), ("q4_K", 0.15), ("q6_K", 0.03)])
def test_quantize_round_trip(qtype, tol):
    x = rnd(3, 512)
    q = ops.quantize(x, qtype)
    assert q.dtype == np.uint8 and q.shape == (3, ops.row_size(qtype, 512))
    y = ops.dequantize(q, qtype)
    assert y.shape == x.shape and y.dtype == np.float32
    err = np.abs(y - x).max() / np.abs(x).max()
    assert err < tol, err
    assert not np.array_equal(y, x)  # it really is lossy
    if qtype in ("q8_0", "q4_0", "q4_1"):  # the gguf package has reference quantizers for these
        import gguf
        from gguf.quants import quantize as gq

        ref = gq(x, getattr(gguf.GGMLQuantizationType, qtype.upper()))
        assert np.mean(q == ref.reshape(q.shape)) > 0.98  # same blocks, up to rounding ties


# ---- lazy graphs


def test_graph_runs_a_chain_as_one_graph():
    w, x, b = rnd(8, 16), rnd(16, 4, seed=1), rnd(8, 1, seed=2)
    with ops.graph("cpu") as g:
        h = ops.silu(ops.add(ops.mul_mat(w, x), b))
        y = ops.soft_max(ops.transpose(h))
    assert isinstance(y, ops.Tensor) and y.shape == (4, 8)
    z = f64(w) @ f64(x) + f64(b)
    ref = _softmax((z / (1 + np.exp(-z))).T)
    close(g.compute(y), ref)
    x2 = rnd(16, 4, seed=7)
    z2 = f64(w) @ f64(x2) + f64(b)
    close(g.compute(y, feed={g._inputs[1]: x2}), _softmax((z2 / (1 + np.exp(-z2))).T))
    # Tensor operator sugar
    with ops.graph() as g2:
        t = (g2.input(w) @ g2.input(x)) * 2.0 - 1.0
    close(g2.compute(t), 2 * f64(w) @ f64(x) - 1)


def test_devices_and_default_backend():
    devs = ops.devices()
    assert any(d["type"] == "cpu" for d in devs)
    cpu = next(d["name"] for d in devs if d["type"] == "cpu")
    with ops.default_backend(cpu):
        close(ops.neg(rnd(3)), -f64(rnd(3)))
    assert ops.check(ops.silu, rnd(64, 64), backend=cpu) == 0.0  # CPU against CPU
    assert ops.nmse(np.array([1.0, 2.0]), np.array([1.0, 2.0])) == 0.0
