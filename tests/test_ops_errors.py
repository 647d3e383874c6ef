"""Misuse of llamabind.ops raises ValueError/TypeError and never aborts the process.

Hypothesis drives every op with random shapes, dtypes and parameters: each call must either raise
ValueError/TypeError or return what numpy (or a shape rule) says. A ggml assert would abort the
whole test run, so any abort path shows up as a crashed suite."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamabind import ops

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.int16, np.int32, np.int64]
CFG = settings(
    max_examples=int(__import__("os").environ.get("LLAMABIND_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)

shapes = st.lists(st.integers(1, 4), min_size=0, max_size=5).map(tuple)
dtypes = st.sampled_from(DTYPES)


def arr(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1, 1], size=shape)).astype(dtype)


def must_raise_or(fn, check=None):
    try:
        out = fn()
    except (ValueError, TypeError):
        return None
    if check is not None:
        check(out)
    return out


@CFG
@given(sa=shapes, sb=shapes, da=dtypes, db=dtypes, name=st.sampled_from(["add", "sub", "mul", "div"]))
def test_binary_random(sa, sb, da, db, name):
    a, b = arr(sa, da), arr(sb, db, 1)
    ref = None
    try:
        with np.errstate(all="ignore"):
            ref = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[name](
                a.astype(np.float64), b.astype(np.float64)
            )
    except ValueError:
        pass

    def check(out):
        assert ref is not None and out.shape == ref.shape and out.dtype == a.dtype
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=2e-2, atol=2e-2)

    must_raise_or(lambda: getattr(ops, name)(a, b), check)


UNARY = [
    "sqr",
    "sqrt",
    "exp",
    "log",
    "abs",
    "neg",
    "silu",
    "gelu",
    "relu",
    "sigmoid",
    "tanh",
    "sum",
    "sum_rows",
    "mean",
    "argmax",
    "cont",
    "transpose",
    "norm",
    "rms_norm",
    "l2_norm",
    "soft_max",
    "argsort",
]


@CFG
@given(s=shapes, d=dtypes, name=st.sampled_from(UNARY))
def test_unary_random(s, d, name):
    must_raise_or(lambda: getattr(ops, name)(arr(s, d)))


@CFG
@given(sa=shapes, sb=shapes, da=dtypes, db=dtypes)
def test_mul_mat_random(sa, sb, da, db):
    a, b = arr(sa, da), arr(sb, db, 1)

    def check(out):
        ref = a.astype(np.float64) @ b.astype(np.float64)
        assert out.shape == ref.shape
        np.testing.assert_allclose(out, ref, rtol=5e-2, atol=5e-2)

    must_raise_or(lambda: ops.mul_mat(a, b), check)
    must_raise_or(lambda: ops.out_prod(a, b))


@CFG
@given(sa=shapes, sb=shapes, da=dtypes, db=dtypes, axis=st.integers(-6, 6))
def test_concat_random(sa, sb, da, db, axis):
    a, b = arr(sa, da), arr(sb, db, 1)

    def check(out):
        np.testing.assert_array_equal(out, np.concatenate([a, b], axis))

    must_raise_or(lambda: ops.concat(a, b, axis), check)


@CFG
@given(
    s=shapes,
    d=dtypes,
    axes=st.lists(st.integers(-5, 5), max_size=5),
    new=st.lists(st.integers(-2, 8), max_size=5),
    reps=st.lists(st.integers(1, 3), max_size=5),
)
def test_views_random(s, d, axes, new, reps):
    a = arr(s, d)
    must_raise_or(lambda: ops.permute(a, axes), lambda out: np.testing.assert_array_equal(out, np.transpose(a, axes)))
    must_raise_or(lambda: ops.reshape(a, new), lambda out: np.testing.assert_array_equal(out, a.reshape(new)))
    target = tuple(r * n for r, n in zip(reps, (1,) * (len(reps) - a.ndim) + a.shape)) if len(reps) >= a.ndim else reps
    must_raise_or(lambda: ops.repeat(a, target))
    must_raise_or(lambda: ops.pad(a, [(r - 1, 1) for r in reps]))
    must_raise_or(lambda: ops.cast(a, DTYPES[len(reps) % len(DTYPES)]))


@CFG
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 5),
    idx=st.lists(st.integers(-3, 9), min_size=0, max_size=5),
    d=dtypes,
    it=st.sampled_from([np.int32, np.int64, np.float32]),
)
def test_rows_random(rows, cols, idx, d, it):
    a = arr((rows, cols), d)
    i = np.array(idx, dtype=it)
    must_raise_or(lambda: ops.get_rows(a, i), lambda out: np.testing.assert_array_equal(out, a[i.astype(int)]))
    src = arr((len(idx), cols), np.float32, 2)
    must_raise_or(lambda: ops.set_rows(a, i, src))


@CFG
@given(
    n_tok=st.integers(1, 4),
    n_head=st.integers(1, 3),
    head_dim=st.integers(1, 20),
    n_dims=st.integers(-2, 24),
    mode=st.sampled_from(["normal", "neox", "mrope", "vision", "imrope", "bogus"]),
    sections=st.one_of(st.none(), st.lists(st.integers(-1, 8), min_size=0, max_size=5)),
    npos=st.integers(0, 20),
    ff=st.one_of(st.none(), st.integers(1, 12)),
    d=dtypes,
    base=st.sampled_from([10000.0, 0.0, -1.0, float("nan")]),
)
def test_rope_random(n_tok, n_head, head_dim, n_dims, mode, sections, npos, ff, d, base):
    x = arr((n_tok, n_head, head_dim), d)
    pos = np.arange(npos, dtype=np.int32)
    factors = None if ff is None else np.ones(ff, np.float32)
    must_raise_or(lambda: ops.rope(x, pos, n_dims, mode, sections=sections, freq_factors=factors, freq_base=base))
    must_raise_or(lambda: ops.rope_back(x, pos, n_dims, mode, sections=sections, freq_factors=factors))


@CFG
@given(s=shapes, ls=shapes, ld=dtypes, gs=shapes)
def test_cross_entropy_loss_random(s, ls, ld, gs):
    """ggml_cross_entropy_loss(_back) assert one shape for logits and float32 labels, or int32 classes of the
    logits' shape less its last axis (patch 0090: any class value, -1, 0 and 1 here, a class outside the row a row
    of zeros), and a scalar gradient."""
    a, y = arr(s, np.float32), arr(ls, ld, 1)
    dense = s == ls and ld == np.float32
    classes = len(s) >= 1 and ls == s[:-1] and ld == np.int32

    def finite_if_same_shape(out):
        assert (dense or classes) and out.shape == () and out.dtype == np.float32
        assert np.isfinite(out).all()

    must_raise_or(lambda: ops.cross_entropy_loss(a, y), finite_if_same_shape)

    def grad_shaped(out):
        assert (dense or classes) and np.prod(gs) == 1 and out.shape == s

    must_raise_or(lambda: ops.cross_entropy_loss_back(arr(gs, np.float32), a, y), grad_shaped)


@CFG
@given(s=st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple), data=st.data())
def test_cross_entropy_loss_classes_random(s, data):
    """Patch 0090: any int32 class of each row, inside [0, classes) or not (a row of zeros), gives the float64 loss of
    the one-hot rows and their gradient; never an abort or a read outside the row."""
    rows = int(np.prod(s[:-1]))
    c = np.array(data.draw(st.lists(st.integers(-3, s[-1] + 3), min_size=rows, max_size=rows)), np.int32)
    c = c.reshape(s[:-1])
    a = arr(s, np.float32, 2)
    inside = (c >= 0) & (c < s[-1])
    y = np.zeros(s, np.float64)
    y.reshape(-1, s[-1])[np.flatnonzero(inside), c.reshape(-1)[inside.reshape(-1)]] = 1.0
    x = a.astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    np.testing.assert_allclose(ops.cross_entropy_loss(a, c), -(y * logp).sum() / rows, rtol=1e-5, atol=1e-6)
    g = np.array([0.5], np.float32)
    want = (np.exp(logp) - y) * 0.5 / rows
    np.testing.assert_allclose(ops.cross_entropy_loss_back(g, a, c), want, rtol=1e-5, atol=1e-7)


@CFG
@given(s=shapes, ms=shapes, md=dtypes, scale=st.floats(-2, 2), max_bias=st.sampled_from([0.0, 8.0, -1.0]))
def test_soft_max_random(s, ms, md, scale, max_bias):
    a = arr(s, np.float32)
    must_raise_or(lambda: ops.soft_max(a, arr(ms, md, 1), scale, max_bias))
    must_raise_or(lambda: ops.soft_max_back(a, arr(ms, np.float32, 1), scale))


@CFG
@given(
    oc=st.integers(1, 3),
    ic=st.integers(1, 3),
    k=st.integers(1, 6),
    n=st.integers(1, 2),
    length=st.integers(1, 9),
    s=st.integers(0, 3),
    p=st.integers(-1, 3),
    dil=st.integers(0, 3),
    kd=dtypes,
    two_d=st.booleans(),
    op=st.sampled_from(["max", "avg", "min"]),
)
def test_conv_pool_random(oc, ic, k, n, length, s, p, dil, kd, two_d, op):
    if two_d:
        kern, data = arr((oc, ic, k, k), kd), arr((n, ic, length, length + 1), np.float32, 1)
        must_raise_or(lambda: ops.conv_2d(kern, data, s, p, dil))
        must_raise_or(lambda: ops.im2col(kern, data, s, p, dil))
        must_raise_or(lambda: ops.pool_2d(data, op, k, s or None, p))
        must_raise_or(lambda: ops.upscale(data, size=(length, k)), lambda out: out.shape[-2:] == (length, k))
    else:
        kern, data = arr((oc, ic, k), kd), arr((n, ic, length), np.float32, 1)
        must_raise_or(lambda: ops.conv_1d(kern, data, s, p, dil))
        must_raise_or(lambda: ops.im2col(kern, data, s, p, dil))
        must_raise_or(lambda: ops.pool_1d(data, op, k, s or None, p))
        must_raise_or(lambda: ops.conv_transpose_1d(arr((ic, oc, k), kd), data[0], s))
    must_raise_or(lambda: ops.group_norm(data, oc))


@CFG
@given(
    b=st.integers(1, 2),
    h=st.integers(1, 4),
    hk=st.integers(1, 4),
    nq=st.integers(1, 4),
    nkv=st.integers(1, 5),
    d=st.sampled_from([4, 8, 16]),
    dk=st.sampled_from([4, 8, 16]),
    kd=dtypes,
    mask=st.booleans(),
    mshape=st.tuples(st.integers(1, 5), st.integers(1, 5)),
)
def test_flash_attn_random(b, h, hk, nq, nkv, d, dk, kd, mask, mshape):
    q = arr((b, h, nq, d), np.float32)
    k, v = arr((b, hk, nkv, dk), kd, 1), arr((b, hk, nkv, dk), kd, 2)
    m = arr(mshape, np.float16, 3) if mask else None
    must_raise_or(lambda: ops.flash_attn_ext(q, k, v, m))


@CFG
@given(
    n=st.integers(1, 600),
    rows=st.integers(1, 3),
    t=st.sampled_from(list(ops.QUANT_TYPES) + ["q5_0", "f32", "x"]),
    k=st.integers(-1, 8),
    dim=st.integers(-1, 9),
    start=st.floats(-5, 5),
    stop=st.floats(-5, 5),
    step=st.floats(-1, 2),
)
def test_misc_random(n, rows, t, k, dim, start, stop, step):
    x = arr((rows, n), np.float32)
    q = must_raise_or(lambda: ops.quantize(x, t))
    if q is not None:
        must_raise_or(lambda: ops.dequantize(q, t), lambda y: y.shape == x.shape)
        must_raise_or(lambda: ops.dequantize(q[:, :-1].copy(), t))
    must_raise_or(lambda: ops.top_k(x, k), lambda out: out.shape == (rows, k))
    must_raise_or(lambda: ops.timestep_embedding(x[0], dim))
    must_raise_or(lambda: ops.arange(start, stop, step))
    must_raise_or(lambda: ops.clamp(x, start, stop))


def test_specific_misuse():
    x = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="at most 4"):
        ops.add(np.ones((1, 1, 1, 1, 2), np.float32), np.ones(2, np.float32))
    with pytest.raises(TypeError, match="float64"):
        ops.add(x.astype(np.float64), x)
    with pytest.raises(TypeError, match="bool"):
        ops.neg(np.ones(3, bool))
    with pytest.raises(ValueError, match=">= 1"):
        ops.neg(np.ones((0, 3), np.float32))
    with pytest.raises(TypeError):
        ops.neg("not an array")
    with pytest.raises(ValueError, match="no backend device"):
        ops.neg(x, backend="cuda:7")
    with pytest.raises(TypeError, match="backend"):
        ops.neg(x, backend=3)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        ops.get_rows(np.ones((3, 2), np.float32), np.array([3], np.int32))
    with pytest.raises(TypeError, match="does not support"):
        ops.soft_max(x.astype(np.float16))
    with ops.graph() as g:
        idx = ops.cast(ops.cast(np.array([0, 1], np.int32), np.float32), np.int32)
        with pytest.raises(ValueError, match="range-checked"):
            ops.get_rows(x, idx)
        y = ops.get_rows(
            x, ops.argsort(np.array([[0.5, 0.1]], np.float32)).reshape(2) if False else np.array([1, 0], np.int32)
        )
    np.testing.assert_array_equal(g.compute(y), x[[1, 0]])


def test_the_interpreter_survives_a_storm_of_bad_calls():
    """The same misuse in a fresh process: it must end normally (an abort would show as -6)."""
    import subprocess
    import sys

    code = """
import numpy as np
from llamabind import ops
bad = [lambda: ops.mul_mat(np.ones((2,3),np.float32), np.ones((2,3),np.float32)),
       lambda: ops.rope(np.ones((2,1,8),np.float32), np.arange(2,dtype=np.int32), 8, 'vision', sections=[0,0,0,4]),
       lambda: ops.repeat(np.ones(2, np.int64), (4,)),
       lambda: ops.concat(np.ones(2,np.int8), np.ones(2,np.int16)),
       lambda: ops.get_rows(np.ones((3,2),np.float32), np.array([-1],np.int32)),
       lambda: ops.flash_attn_ext(np.ones((1,3,2,8),np.float32), np.ones((1,2,2,8),np.float16),
                                  np.ones((1,2,2,8),np.float16)),
       lambda: ops.grad(lambda v: ops.sum(ops.clamp(v, 0.0, 1.0)))(np.ones(3,np.float32))]
n = 0
for f in bad:
    try:
        f()
    except (ValueError, TypeError):
        n += 1
print(n)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "7"
