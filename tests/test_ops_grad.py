"""llamabind.ops backward: grad/vjp and the *_back ops against central finite differences, and
regression tests for the upstream fixes of the patch series' README."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import TEST_BACKEND
from test_ops import rnd, rope_ref

from llamabind import _core, ops


def fd_grad(f, xs, i, eps=1e-2):
    """Central finite differences of scalar f(*xs) (float64 evaluation of a float32 ggml graph)."""
    x = xs[i].astype(np.float64)
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        for sgn in (1, -1):
            xp = x.copy()
            xp[idx] += sgn * eps
            args = list(xs)
            args[i] = xp.astype(np.float32)
            g[idx] += sgn * float(f(*args))
    return g / (2 * eps)


def check_grad(f, *xs, tol=2e-2, argnums=None):
    argnums = tuple(range(len(xs))) if argnums is None else argnums
    got = ops.grad(f, argnums=argnums)(*xs)
    for i, gi in zip(argnums, got):
        ref = fd_grad(f, xs, i)
        assert gi.shape == xs[i].shape and gi.dtype == np.float32
        np.testing.assert_allclose(gi, ref, rtol=tol, atol=tol * max(1.0, np.abs(ref).max()))


W = rnd(3, 4, seed=11)


@pytest.mark.parametrize(
    "name,f,lo,hi",
    [
        ("sqr", lambda x: ops.sum(ops.sqr(x)), -2, 2),
        ("sqrt", lambda x: ops.sum(ops.sqrt(x)), 0.5, 3),
        ("log", lambda x: ops.sum(ops.mul(ops.log(x), W)), 0.5, 3),
        ("exp", lambda x: ops.sum(ops.mul(ops.exp(x), W)), -1, 1),
        ("abs", lambda x: ops.sum(ops.mul(ops.abs(x), W)), 0.2, 1),
        ("relu", lambda x: ops.sum(ops.mul(ops.relu(x), W)), 0.2, 1),
        ("silu", lambda x: ops.sum(ops.mul(ops.silu(x), W)), -2, 2),
        ("scale", lambda x: ops.sum(ops.scale(ops.mul(x, W), 3.0)), -2, 2),
        ("div", lambda x: ops.sum(ops.div(W, ops.add(ops.sqr(x), 1.0))), -2, 2),
        ("soft_max", lambda x: ops.sum(ops.mul(ops.soft_max(x), W)), -2, 2),
        ("rms_norm", lambda x: ops.sum(ops.mul(ops.rms_norm(x, 1e-5), W)), -2, 2),
        ("norm", lambda x: ops.sum(ops.mul(ops.norm(x, 1e-5), W)), -2, 2),  # patch 0015
        ("tanh", lambda x: ops.sum(ops.mul(ops.tanh(x), W)), -2, 2),  # patch 0015
        ("sigmoid", lambda x: ops.sum(ops.mul(ops.sigmoid(x), W)), -3, 3),  # patch 0015
        ("mean", lambda x: ops.sum(ops.sqr(ops.mean(x))), -2, 2),
        ("sum_rows", lambda x: ops.sum(ops.sqr(ops.sum_rows(x))), -2, 2),
        ("transpose", lambda x: ops.sum(ops.mul(ops.cont(ops.transpose(x)), W.T.copy())), -2, 2),
        ("permute", lambda x: ops.sum(ops.sqr(ops.permute(x, (1, 0)))), -2, 2),
        ("reshape", lambda x: ops.sum(ops.mul(ops.reshape(x, (2, 6)), W.reshape(2, 6))), -2, 2),
        ("repeat", lambda x: ops.sum(ops.mul(ops.repeat(x, (6, 4)), np.tile(W, (2, 1)))), -2, 2),
        ("get_rows", lambda x: ops.sum(ops.sqr(ops.get_rows(x, np.array([2, 0, 2], np.int32)))), -2, 2),
    ],
)
def test_grad_single_input(name, f, lo, hi):
    check_grad(f, rnd(3, 4, lo=lo, hi=hi, seed=len(name)))


def test_gelu_grad_is_the_tanh_form_derivative():
    """patch 0015. Not by finite differences of ggml's forward: the CPU GELU reads an f16 table."""
    x = rnd(4, 9, lo=-4, hi=4)
    got = ops.grad(lambda v: ops.sum(ops.mul(ops.gelu(v), W3)))(x)
    c, a, xd = np.sqrt(2 / np.pi), 0.044715, x.astype(np.float64)
    t = np.tanh(c * (xd + a * xd**3))
    want = W3 * 0.5 * ((1 + t) + xd * (1 - t * t) * c * (1 + 3 * a * xd * xd))
    tol = 1e-4 if TEST_BACKEND not in (None, "cpu") else 1e-5  # CUDA's tanhf/expf differ in the last bits
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


W3 = rnd(4, 9, seed=12)


def test_grad_two_inputs_and_argnums():
    a, b = rnd(3, 5), rnd(5, 2, seed=1)
    f = lambda a, b: ops.sum(ops.sqr(ops.mul_mat(a, b)))  # noqa: E731
    check_grad(f, a, b)
    ga = ops.grad(f)(a, b)  # argnums=0: one array
    assert isinstance(ga, np.ndarray) and ga.shape == a.shape
    ref = 2 * (a.astype(np.float64) @ b) @ b.T
    tol = 3e-3 if TEST_BACKEND not in (None, "cpu") else 1e-4  # TF32 mat-mul on CUDA (see test_ops.GPU_TOL)
    np.testing.assert_allclose(ga, ref, rtol=tol, atol=tol)
    check_grad(lambda x, y: ops.sum(ops.mul(ops.sub(x, y), ops.add(x, y))), a, rnd(3, 5, seed=4))


def test_grad_and_vjp_take_device_arrays_and_return_them_on_their_device():
    """A DeviceArray argument (ops.to_device; a torch CUDA tensor through ops.from_dlpack is one):
    grad raised TypeError "expected a numpy array"; now the gradient runs on its device and comes
    back there, equal to the numpy path's and to the closed form."""
    a, b = rnd(3, 5), rnd(5, 2, seed=1)
    f = lambda a, b: ops.sum(ops.sqr(ops.mul_mat(a, b)))  # noqa: E731
    da = ops.to_device(a)
    ga, gb = ops.grad(f, argnums=(0, 1))(da, b)  # one DeviceArray is enough
    assert type(ga) is ops.DeviceArray and ga.device == da.device and ga.shape == a.shape
    ref = 2 * (a.astype(np.float64) @ b) @ b.T
    tol = 3e-3 if TEST_BACKEND not in (None, "cpu") else 1e-4
    np.testing.assert_allclose(ga.numpy(), ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(gb.numpy(), ops.grad(f, argnums=1)(a, b), rtol=1e-5, atol=1e-5)
    x, w = np.ascontiguousarray(a[:, :2]), np.ascontiguousarray(b[:3])
    y, f_vjp = ops.vjp(lambda x, w: ops.mul(x, w), ops.to_device(x), w)
    assert type(y) is ops.DeviceArray
    ct = rnd(3, 2, seed=3)
    gx, gw = f_vjp(ops.to_device(ct))
    assert type(gx) is ops.DeviceArray and gx.device == da.device
    np.testing.assert_allclose(y.numpy(), x * w, rtol=1e-6)
    np.testing.assert_allclose(gx.numpy(), ct * w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw.numpy(), ct * x, rtol=1e-5, atol=1e-6)


def test_grad_of_a_torch_tensor_stays_on_its_device():
    """The issue's case: a torch tensor (CUDA when there is one) through ops.from_dlpack."""
    torch = pytest.importorskip("torch")
    dev = "cuda" if torch.cuda.is_available() and TEST_BACKEND in (None, "cuda") else "cpu"
    t = torch.linspace(-1, 1, 12, device=dev).reshape(3, 4)
    x = ops.from_dlpack(t)
    g = ops.grad(lambda x: ops.sum(ops.sqr(x)))(x)
    assert type(g) is ops.DeviceArray and g.device == x.device
    back = torch.from_dlpack(g)
    assert back.device.type == dev
    torch.testing.assert_close(back, 2 * t)


def test_vjp_matches_jacobian_products():
    x = rnd(4, 6)
    y, f_vjp = ops.vjp(lambda x: ops.soft_max(x, scale=0.5), x)
    e = np.exp(0.5 * (x - x.max(-1, keepdims=True)).astype(np.float64))
    s = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(y, s, rtol=1e-5, atol=1e-6)
    ct = rnd(4, 6, seed=3)
    (gx,) = f_vjp(ct)
    np.testing.assert_allclose(gx, 0.5 * s * (ct - (s * ct).sum(-1, keepdims=True)), rtol=1e-4, atol=1e-5)
    (gx2,) = f_vjp(ct * 2)  # the compiled graph is reused with a new cotangent
    np.testing.assert_allclose(gx2, 2 * gx, rtol=1e-5, atol=1e-6)


def test_backward_ops_against_finite_differences():
    x, dy = rnd(3, 7), rnd(3, 7, seed=1)
    dot = lambda f: lambda x: float((f(x).astype(np.float64) * dy).sum())  # noqa: E731
    np.testing.assert_allclose(ops.silu_back(dy, x), fd_grad(dot(ops.silu), [x], 0), rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(
        ops.rms_norm_back(dy, x, 1e-5), fd_grad(dot(lambda v: ops.rms_norm(v, 1e-5)), [x], 0), rtol=2e-2, atol=2e-3
    )
    y = ops.soft_max(x)
    np.testing.assert_allclose(ops.soft_max_back(dy, y), fd_grad(dot(ops.soft_max), [x], 0), rtol=2e-2, atol=2e-3)


def test_swiglu_gradients_against_finite_differences():
    """ggml's backward of a split SwiGLU (silu_back of dy*b for the gate, silu(a)*dy for the up projection;
    on CUDA one fused kernel, patch 0059) against central differences of the float64-summed loss."""
    a, b, w = rnd(3, 7), rnd(3, 7, seed=1), rnd(3, 7, seed=2)

    def loss(a, b):
        return ops.sum(ops.mul(ops.swiglu(a, b), w))

    ga, gb = ops.grad(loss, argnums=(0, 1))(a, b)
    f = lambda a, b: float((ops.swiglu(a, b).astype(np.float64) * w).sum())  # noqa: E731
    np.testing.assert_allclose(ga, fd_grad(f, [a, b], 0), rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(gb, fd_grad(f, [a, b], 1), rtol=2e-2, atol=2e-3)


def test_swiglu_gradients_of_bfloat16_inputs_against_float64():
    """Patch 0069: a split SwiGLU over BF16 gate and up activations (what mixed-precision training keeps since)
    has F32 gradients: the backward multiplies the F32 gradient first (ggml.c), and on CUDA the fused SwiGLU
    backward reads BF16 g and u. Against float64 on the BF16-rounded inputs: da = dy*u*silu'(g), db =
    dy*bf16(silu(g)) (silu(g) is a BF16 node, rounded as such), NMSE < 1e-6 (F32 arithmetic, the GPU's fast
    exp; a last-bit difference of silu(g) can move its BF16 rounding by 2^-8 for a few elements). The CPU has
    no F32 x BF16 product for that backward: the gradient graph raises TypeError there, nothing aborts."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    a, b, w = rnd(64, 300), rnd(64, 300, seed=1), rnd(64, 300, seed=2)

    def loss(a, b):
        s = ops.swiglu(ops.cast(a, bf16), ops.cast(b, bf16))
        return ops.sum(ops.cast(ops.mul(s, w), np.float32))

    if TEST_BACKEND in (None, "cpu"):
        with pytest.raises(TypeError, match="not supported"):
            ops.grad(loss, argnums=(0, 1))(a, b)
        return
    ga, gb = ops.grad(loss, argnums=(0, 1))(a, b)
    g, u = (x.astype(bf16).astype(np.float64) for x in (a, b))
    dy = w.astype(np.float64)
    sg = 1 / (1 + np.exp(-g))
    want_a = dy * u * sg * (1 + g * (1 - sg))
    want_b = dy * (g * sg).astype(bf16).astype(np.float64)
    assert ops.nmse(ga, want_a) < 1e-6, ops.nmse(ga, want_a)
    assert ops.nmse(gb, want_b) < 1e-6, ops.nmse(gb, want_b)


def test_gradient_through_a_bfloat16_cast_passes_straight_through():
    """A round trip through bfloat16 (ggml_cast both ways) has the identity's gradient, as autocast's casts do in
    PyTorch (ggml's CPY backward rule; the binding's check let gradients through no BF16 tensor before patch 0069's
    change): d sum(cast(cast(x, bf16), f32) * w) / dx = w exactly, on every backend."""
    x, w = rnd(5, 33), rnd(5, 33, seed=4)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    g = ops.grad(lambda x: ops.sum(ops.mul(ops.cast(ops.cast(x, bf16), np.float32), w)))(x)
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize(
    "mode,sections",
    [("normal", None), ("neox", None), ("mrope", [4, 2, 2, 0]), ("imrope", [4, 2, 2, 0]), ("vision", [4, 4, 0, 0])],
)
def test_rope_back_is_the_gradient_of_rope(mode, sections):
    """Upstream fix PR #24725 (b9690, Metal rope_back); here: rope_back == d rope for every mode."""
    n_tok = 3
    x = rnd(n_tok, 2, 16)
    multi = sections is not None
    pos = (np.arange(4 * n_tok, dtype=np.int32) * 3 + 1) if multi else np.array([1, 5, 40], np.int32)
    n_dims = 8 if mode == "vision" else 16  # vision rotates head_dim/2 pairs of (x, y) positions
    dy = rnd(n_tok, 2, 16, seed=2)
    kw = dict(sections=sections, freq_base=1000.0)
    back = ops.rope_back(dy, pos, n_dims, mode, **kw)
    fd = fd_grad(lambda v: float((ops.rope(v, pos, n_dims, mode, **kw).astype(np.float64) * dy).sum()), [x], 0)
    np.testing.assert_allclose(back, fd, rtol=2e-2, atol=2e-3)
    if mode in ("normal", "neox"):  # and ggml's backward graph of rope uses it
        g = ops.grad(lambda v: ops.sum(ops.mul(ops.rope(v, pos, n_dims, mode, **kw), dy)))(x)
        np.testing.assert_allclose(g, back, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            ops.rope(x, pos, n_dims, mode, freq_base=1000.0),
            rope_ref(x, pos, n_dims, mode, 1000.0),
            rtol=1e-4,
            atol=1e-4,
        )


def test_rms_norm_back_seed_fix():
    """Upstream fix PR #24305 (b9572): dz = x = [1, 0, 0, 0], eps = 1e-4 gives 0.000799, not -3.9976."""
    x = np.array([[1, 0, 0, 0]], np.float32)
    want = np.array([[0.000799, 0, 0, 0]])
    np.testing.assert_allclose(ops.rms_norm_back(x, x, 1e-4), want, atol=1e-6)
    # inside a graph where ggml_gallocr places dx on dz's buffer (the aliasing that broke it)
    dx, aliased = _core._testing.rms_norm_back_graph(x, x, 1e-4)
    assert aliased, "dx was not placed on dz: the test no longer reaches the aliasing path"
    np.testing.assert_allclose(dx, want, atol=1e-6)
    # and through ggml's backward graph of rms_norm
    g = ops.grad(lambda v, w: ops.sum(ops.mul(ops.rms_norm(v, 1e-4), w)), argnums=0)(x, x)
    np.testing.assert_allclose(g, want, atol=1e-6)


def test_cross_entropy_loss_gradient_matches_finite_differences():
    """The loss llama.cpp's training minimizes: its backward (CROSS_ENTROPY_LOSS_BACK) against finite
    differences; the labels take no gradient (TypeError, not ggml's assert)."""
    x = rnd(4, 9)
    labels = np.eye(9, dtype=np.float32)[[1, 8, 0, 4]]
    g = ops.grad(lambda a: ops.cross_entropy_loss(a, labels))(x)
    np.testing.assert_allclose(g, fd_grad(lambda a: ops.cross_entropy_loss(a, labels), [x], 0), rtol=2e-2, atol=2e-3)
    with pytest.raises(TypeError, match="no backward"):
        ops.grad(lambda a, y: ops.cross_entropy_loss(a, y), argnums=1)(x, labels)


def test_soft_max_back_seed_patch_through_ops():
    """patches/0001 through the public op (the allocation-level check is in test_patches.py)."""
    a, dy = rnd(3, 8), rnd(3, 8, seed=5)
    e = np.exp(a - a.max(-1, keepdims=True)).astype(np.float64)
    y = e / e.sum(-1, keepdims=True)
    ref = y * (dy - (y * dy).sum(-1, keepdims=True))
    np.testing.assert_allclose(ops.soft_max_back(dy, y.astype(np.float32)), ref, rtol=1e-5, atol=1e-6)


def test_grad_errors_are_exceptions():
    x = rnd(3, 4)
    with pytest.raises(TypeError, match="no backward"):
        ops.grad(lambda v: ops.sum(ops.clamp(v, -1.0, 1.0)))(x)
    with pytest.raises(ValueError, match="scalar"):
        ops.grad(lambda v: ops.sqr(v))(x)
    with pytest.raises(TypeError, match="float32"):
        ops.grad(lambda v: ops.sum(ops.sqr(v)))(x.astype(np.float16))
    with pytest.raises(ValueError, match="does not depend"):
        ops.grad(lambda v, w: ops.sum(ops.sqr(w)), argnums=0)(x, x)
    with pytest.raises(TypeError):
        ops.grad(lambda v: 3.0)(x)
    y, f_vjp = ops.vjp(ops.silu, x)
    with pytest.raises(ValueError, match="cotangent"):
        f_vjp(np.zeros((2, 2), np.float32))


def _attention_f64(q, k, v, mask, scale, softcap=0.0, max_bias=0.0):
    """softmax(scale q k^T (softcapped) + slope_h mask) v in float64, written from ggml_flash_attn_ext's
    definition: q (B, H, N, D), k/v (B, Hk, M, D), grouped-query heads h -> h // (H / Hk); ALiBi slopes
    per head as ggml's (m0^(h+1) for the first 2^floor(log2 H) heads, then m1^(2(h - n) + 1))."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    h, hk = q.shape[1], k.shape[1]
    k, v = np.repeat(k, h // hk, axis=1), np.repeat(v, h // hk, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    n = 1 << int(np.floor(np.log2(h)))
    m0, m1 = 2.0 ** (-max_bias / n), 2.0 ** (-max_bias / 2 / n)
    slope = np.array([(m0 ** (i + 1) if i < n else m1 ** (2 * (i - n) + 1)) if max_bias else 1.0 for i in range(h)])
    s = s + slope[None, :, None, None] * np.asarray(mask, np.float64)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def _fd64(f, xs, i, eps=1e-6):
    """Central differences of a float64 function."""
    x = xs[i].astype(np.float64)
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        for sgn in (1, -1):
            args = [np.asarray(a, np.float64) for a in xs]
            args[i] = x.copy()
            args[i][idx] += sgn * eps
            g[idx] += sgn * f(*args)
    return g / (2 * eps)


@pytest.mark.parametrize(
    "b,h,hk,n,m,d,softcap,max_bias",
    [
        (2, 4, 2, 5, 7, 16, 0.0, 0.0),  # grouped-query heads, two sequences, a causal-like mask
        (1, 3, 3, 9, 9, 8, 2.0, 0.0),  # softcap
        (1, 4, 1, 6, 6, 8, 0.0, 1.5),  # ALiBi over one K/V head
    ],
)
def test_flash_attn_ext_gradients_match_float64_and_finite_differences(b, h, hk, n, m, d, softcap, max_bias):
    """patch 0050: ggml_flash_attn_ext's backward (ggml_flash_attn_ext_back, FlashAttention-2's
    recomputation) for q, k and v: against central differences of the float64 attention above, to
    float32's rounding (1e-4 of the largest entry); rows of -inf in the mask, GQA, softcap, ALiBi.
    The gradient of a mask is refused (TypeError), not ggml's assert."""
    rng = np.random.default_rng(n * m + d)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((b, h, n, d), (b, hk, m, d), (b, hk, m, d)))
    mask = np.triu(np.full((n, m), -np.inf, np.float32), m - n + 1) + rng.normal(0, 0.3, (n, m))
    mask = mask.astype(np.float16)
    w = rng.standard_normal((b, h, n, d)).astype(np.float32)
    scale = 0.4
    kw = dict(scale=scale, logit_softcap=softcap, max_bias=max_bias)
    try:
        got = ops.grad(lambda q, k, v: ops.sum(ops.mul(ops.flash_attn_ext(q, k, v, mask, **kw), w)), argnums=(0, 1, 2))(
            q, k, v
        )
    except TypeError as err:  # a device without this configuration's backward (the GPU test is test_ops_backends')
        pytest.skip(str(err))

    def loss(q, k, v):
        return float((_attention_f64(q, k, v, mask, scale, softcap, max_bias) * w).sum())

    for i, g in enumerate(got):
        ref = _fd64(loss, [q, k, v], i)
        err = np.abs(g - ref).max() / np.abs(ref).max()
        assert g.shape == ref.shape and err < 1e-4, (i, err)
    with pytest.raises(TypeError, match="no backward"):
        ops.grad(lambda mk: ops.sum(ops.flash_attn_ext(q, k, v, ops.cast(mk, np.float16))))(mask.astype(np.float32))
