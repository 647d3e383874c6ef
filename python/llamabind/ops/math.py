"""Element-wise ops, reductions and matrix products.

Shapes are numpy's (at most 4 axes). Every function takes numpy arrays (or ops.Tensor inside a
graph) and ``backend=`` (default: "cpu", or the one set by ops.default_backend).
"""

from __future__ import annotations

import numpy as np

from .._validate import one_of
from .eager import apply
from .graph import BF16, F16, F32, FLOATS, OPERATORS, Graph, Tensor, as_float, expect, expect_dtype, shape_to_ne

# dtype pairs (a, b) of ggml's binary kernels (ggml-cpu binary-ops.cpp); the result has a's dtype
_BINARY_PAIRS = {(F32, F32), (F16, F16), (F16, F32)} | ({(BF16, BF16), (BF16, F32)} if BF16 is not None else set())


def _broadcast(g: Graph, op: str, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    try:
        out = np.broadcast_shapes(a.shape, b.shape)
    except ValueError:
        raise ValueError(f"{op}: shapes {a.shape} and {b.shape} do not broadcast") from None
    if (a.dtype, b.dtype) not in _BINARY_PAIRS:
        ok = ", ".join(
            f"({x.name if x is not BF16 else 'bfloat16'}, {y.name if y is not BF16 else 'bfloat16'})"
            for x, y in sorted(_BINARY_PAIRS, key=str)
        )
        raise TypeError(
            f"{op}: ggml has no kernel for dtypes ({a.dtype}, {b.dtype}) on backend {g.device}; supported: {ok}"
        )
    if a.shape != out:  # ggml broadcasts only b into a: tile a first
        a = g.op("repeat_4d", [a], shape_to_ne(out), shape=out)
    return a, b


def _binary(name: str, doc_op: str):
    def build(g: Graph, a: Tensor, b: Tensor) -> Tensor:
        a, b = _broadcast(g, name, a, b)
        return g.op(name, [a, b], shape=a.shape)

    def fn(a, b, *, backend: str | None = None):
        return apply(build, (a, b), {}, backend)

    fn.__name__ = fn.__qualname__ = name  # a module-level name for tracebacks and the API reference
    fn.__doc__ = f"""Element-wise ``{doc_op}`` with numpy broadcasting (wraps ggml_{name}).

    a, b: arrays whose shapes broadcast; dtypes (float32, float32), (float16, float16),
    (bfloat16, bfloat16), or (float16|bfloat16, float32). Returns a's dtype, the broadcast shape.
    Raises ValueError (shapes), TypeError (dtypes)."""
    return fn


add = _binary("add", "a + b")
sub = _binary("sub", "a - b")
mul = _binary("mul", "a * b")
div = _binary("div", "a / b")


def _unary(name: str, formula: str, dtypes=FLOATS):
    def build(g: Graph, a: Tensor) -> Tensor:
        expect_dtype(name, "a", a, dtypes, g.device)
        return g.op(name, [a], shape=a.shape)

    def fn(a, *, backend: str | None = None):
        return apply(build, (a,), {}, backend)

    fn.__name__ = fn.__qualname__ = name  # a module-level name for tracebacks and the API reference
    names = ", ".join("bfloat16" if d is BF16 else d.name for d in dtypes)
    fn.__doc__ = (
        f"""Element-wise ``{formula}`` (wraps ggml_{name}). a: any shape, dtype {names}; same shape and dtype out."""
    )
    return fn


sqr = _unary("sqr", "a**2")
sqrt = _unary("sqrt", "sqrt(a)")
exp = _unary("exp", "exp(a)")
log = _unary("log", "log(a)")
abs = _unary("abs", "|a|")  # noqa: A001 - the ggml name
neg = _unary("neg", "-a")
silu = _unary("silu", "a * sigmoid(a)")
gelu = _unary("gelu", "0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))  (ggml's tanh approximation)")
relu = _unary("relu", "max(a, 0)")
sigmoid = _unary("sigmoid", "1 / (1 + exp(-a))")
tanh = _unary("tanh", "tanh(a)")


def _scale(g: Graph, a: Tensor, s: float) -> Tensor:
    expect_dtype("scale", "a", a, tuple(d for d in (F32, BF16) if d is not None), g.device)
    return g.op("scale", [a], floats=[s], shape=a.shape)


def scale(a, s: float, *, backend: str | None = None):
    """``a * s`` for a float scalar s (wraps ggml_scale). a: float32 or bfloat16, any shape."""
    return apply(_scale, (a,), {"s": as_float(s, "s")}, backend)


def _clamp(g: Graph, a: Tensor, min: float, max: float) -> Tensor:
    expect_dtype("clamp", "a", a, FLOATS, g.device)
    return g.op("clamp", [a], floats=[min, max], shape=a.shape)


def clamp(a, min: float, max: float, *, backend: str | None = None):
    """Element-wise ``min(max(a, min), max)`` (wraps ggml_clamp). a: float32/float16/bfloat16.
    Raises ValueError if min > max."""
    lo, hi = as_float(min, "min"), as_float(max, "max")
    expect(lo <= hi, f"clamp: min ({lo}) must be <= max ({hi})")
    return apply(_clamp, (a,), {"min": lo, "max": hi}, backend)


def _same_shape_pair(op: str, names: tuple[str, str], dtypes: tuple = (F32, F16)):
    """The graph builder of a two-input element-wise op whose inputs share one shape and one dtype (one of
    dtypes)."""

    def build(g: Graph, a: Tensor, b: Tensor) -> Tensor:
        expect(a.shape == b.shape, f"{op}: {names[0]} {a.shape} and {names[1]} {b.shape} must have the same shape")
        for n, t in zip(names, (a, b)):
            expect_dtype(op, n, t, dtypes, g.device)
        expect(a.dtype == b.dtype, f"{op}: {names[0]} and {names[1]} must have the same dtype")
        return g.op(op, [a, b], shape=a.shape)

    return build


_silu_back = _same_shape_pair("silu_back", ("dy", "x"))


def silu_back(dy, x, *, backend: str | None = None):
    """Gradient of silu: ``dy * sigmoid(x) * (1 + x * (1 - sigmoid(x)))`` (wraps ggml_silu_back).
    dy, x: same shape, float32 or float16."""
    return apply(_silu_back, (dy, x), {}, backend)


_swiglu = _same_shape_pair("swiglu", ("a", "b"), FLOATS)


def swiglu(a, b, *, backend: str | None = None):
    """SwiGLU, the activation of llama-style FFNs: ``silu(a) * b`` element-wise, a the gate and b the up
    projection (wraps ggml_swiglu_split). a, b: same shape, float32, float16 or bfloat16 (computed in float32,
    rounded to the dtype); same shape and dtype out. Differentiable in both (ggml's backward of a split SwiGLU;
    for bfloat16 inputs the gradients are float32 where the backend has the kernels: CUDA, patch 0069; elsewhere
    the gradient graph raises TypeError). Raises ValueError for other shapes, TypeError for other dtypes."""
    return apply(_swiglu, (a, b), {}, backend)


# ---- reductions


def _sum(g: Graph, a: Tensor) -> Tensor:
    expect_dtype("sum", "a", a, FLOATS, g.device)
    return g.op("sum", [a], shape=())


def sum(a, *, backend: str | None = None):  # noqa: A001 - the ggml name
    """Sum of all elements: shape () with a's dtype (wraps ggml_sum). a: float32/float16/bfloat16."""
    return apply(_sum, (a,), {}, backend)


def _rows(name: str):
    def build(g: Graph, a: Tensor) -> Tensor:
        expect_dtype(name, "a", a, (F32,), g.device)
        return g.op(name, [a], shape=a.shape[:-1] + (1,) if a.ndim else (1,))

    return build


_sum_rows, _mean = _rows("sum_rows"), _rows("mean")


def sum_rows(a, *, backend: str | None = None):
    """Sum over the last axis, keeping it: shape (..., 1) (wraps ggml_sum_rows). a: float32."""
    return apply(_sum_rows, (a,), {}, backend)


def mean(a, *, backend: str | None = None):
    """Mean over the last axis, keeping it: shape (..., 1) (wraps ggml_mean). a: float32."""
    return apply(_mean, (a,), {}, backend)


def _argmax(g: Graph, a: Tensor) -> Tensor:
    expect_dtype("argmax", "a", a, (F32,), g.device)
    expect(a.ndim in (1, 2), f"argmax: a must be 1-D or 2-D (ggml_argmax takes a matrix); got shape {a.shape}")
    t = g.op("argmax", [a], shape=a.shape[:-1])
    t.bound = a.shape[-1]
    return t


def argmax(a, *, backend: str | None = None):
    """Index of the largest element of each row (last axis): int32, shape a.shape[:-1]
    (wraps ggml_argmax). a: float32, 1-D (n,) or 2-D (rows, n). Of equal maxima the last index wins
    on every backend (ggml's CPU kernel; CUDA with patch 0041), where numpy's argmax takes the first.
    Raises TypeError for another dtype and ValueError for another number of dimensions."""
    return apply(_argmax, (a,), {}, backend)


# ---- matrix products


def _mul_mat_quantized(g: Graph, a: Tensor, b: Tensor) -> Tensor:
    # a: quantized rows (M, K) as a model stores a weight; numpy c = a @ b  <=>  ggml: c^T =
    # mul_mat(a, b^T contiguous), ne [K, M] x [K, N] -> [M, N]. Its backward pass reaches b
    # through ggml_out_prod(a, grad^T): the quantized OUT_PROD of QLoRA training.
    expect_dtype("mul_mat", "b", b, (F32,), g.device)
    expect(
        a.ndim == 2 and b.ndim in (1, 2), f"mul_mat: quantized a must be 2-D and b 1-D or 2-D; got {a.shape}, {b.shape}"
    )
    b2 = b if b.ndim == 2 else g.op("reshape_4d", [b], shape_to_ne(b.shape + (1,)), shape=b.shape + (1,))
    (m, k), (k2, n) = a.shape, b2.shape
    expect(k == k2, f"mul_mat: a {a.shape} @ b {b.shape}: inner dimensions {k} and {k2} differ")
    bt = g.op("cont", [g.op("transpose", [b2], shape=(n, k), contiguous_srcs=False)], shape=(n, k))
    ct = g.op("mul_mat", [a, bt], shape=(n, m))
    c = g.op("cont", [g.op("transpose", [ct], shape=(m, n), contiguous_srcs=False)], shape=(m, n))
    return c if b.ndim == 2 else g.op("reshape_4d", [c], shape_to_ne((m,)), shape=(m,))


def _mul_mat(g: Graph, a: Tensor, b: Tensor, precision: str = "f32") -> Tensor:
    if a.ggml_type is not None:
        expect(precision == "f32", "mul_mat: precision='bf16' is for float32 operands")
        return _mul_mat_quantized(g, a, b)
    one_of(precision, "precision", ("f32", "bf16"))
    expect(precision == "f32" or a.dtype == b.dtype == F32, "mul_mat: precision='bf16' is for float32 operands")
    ok_b = FLOATS
    expect_dtype("mul_mat", "b", b, ok_b, g.device)
    allowed_a = {F32, b.dtype} | ({BF16} if b.dtype == F32 and BF16 is not None else set())
    expect_dtype("mul_mat", "a", a, tuple(allowed_a), g.device)
    a2 = a if a.ndim >= 2 else g.op("reshape_4d", [a], shape_to_ne((1,) + a.shape), shape=(1,) + a.shape)
    b2 = b if b.ndim >= 2 else g.op("reshape_4d", [b], shape_to_ne(b.shape + (1,)), shape=b.shape + (1,))
    m, k = a2.shape[-2:]
    k2, n = b2.shape[-2:]
    expect(k == k2, f"mul_mat: a {a.shape} @ b {b.shape}: inner dimensions {k} and {k2} differ")
    try:
        batch = np.broadcast_shapes(a2.shape[:-2], b2.shape[:-2])
    except ValueError:
        raise ValueError(f"mul_mat: batch dimensions of {a.shape} and {b.shape} do not broadcast") from None
    expect(len(batch) <= 2, "mul_mat: at most 2 batch dimensions")
    if a2.shape[:-2] != batch:  # ggml broadcasts only the first operand (b here): tile a
        a2 = g.op("repeat_4d", [a2], shape_to_ne(batch + (m, k)), shape=batch + (m, k))
    # numpy c = a @ b  <=>  ggml: c^T = mul_mat(b^T (contiguous), a)
    bt = g.op("transpose", [b2], shape=b2.shape[:-2] + (n, k), contiguous_srcs=False)
    bt = g.op("cont", [bt], shape=bt.shape)
    out_shape = batch + (m, n)
    c = g.op("mul_mat" if precision == "f32" else "mul_mat_bf16", [bt, a2], shape=out_shape)
    if a.ndim == 1 and b.ndim == 1:
        return g.op("reshape_4d", [c], [1, 1, 1, 1], shape=())
    if a.ndim == 1:
        return g.op("reshape_4d", [c], shape_to_ne(batch + (n,)), shape=batch + (n,))
    if b.ndim == 1:
        return g.op("reshape_4d", [c], shape_to_ne(batch + (m,)), shape=batch + (m,))
    return c


def mul_mat(a, b, *, precision: str = "f32", backend: str | None = None):
    """Matrix product with numpy's ``a @ b`` semantics (wraps ggml_mul_mat; ggml's transposed
    operand convention is handled here).

    a: (..., M, K), b: (..., K, N), 1-D operands as in numpy; batch axes broadcast (at most 2).
    dtypes: b float32/float16/bfloat16 and a float32 or b's dtype (also bfloat16 a with float32 b);
    or a quantized weight, :class:`ops.Blocks` of M rows of K values (``ops.quantize``), with a
    float32 b (K, N) or (K,) — a model's ``W @ x``; its gradient w.r.t. b runs ggml_out_prod of
    the quantized W. ``precision``: ``"f32"``, or ``"bf16"`` for float32 a and b: the backend may run
    the product, and the OUT_PRODs of its gradient, in BF16 with F32 accumulation as mixed-precision
    training does (ggml_prec_set_src; CUDA from Ampere on, CPUs with AVX512_BF16: patches 0051,
    0055; elsewhere F32). Returns float32 (..., M, N). Raises ValueError (shapes, precision),
    TypeError (dtypes).
    """
    return apply(_mul_mat, (a, b), {} if precision == "f32" else {"precision": precision}, backend)


def _out_prod(g: Graph, a: Tensor, b: Tensor, precision: str = "f32") -> Tensor:
    expect_dtype("out_prod", "a", a, (F32,), g.device)
    one_of(precision, "precision", ("f32", "bf16"))
    expect(
        precision == "f32" or (b.ggml_type is None and b.dtype == F32), "out_prod: precision='bf16' is for float32 b"
    )
    if b.ggml_type is None:
        expect_dtype("out_prod", "b", b, (F32,) + tuple(t for t in (F16, BF16) if t is not None), g.device)
    else:
        expect(b.ndim == 2, f"out_prod: quantized b must be 2-D; got {b.shape}")
    a2 = a if a.ndim >= 2 else g.op("reshape_4d", [a], shape_to_ne((1,) + a.shape), shape=(1,) + a.shape)
    b2 = b if b.ndim >= 2 else g.op("reshape_4d", [b], shape_to_ne((1,) + b.shape), shape=(1,) + b.shape)
    expect(a2.ndim == 2 and b2.ndim == 2, f"out_prod: a and b must be 1-D or 2-D; got {a.shape} and {b.shape}")
    expect(a2.shape[0] == b2.shape[0], f"out_prod: a {a.shape} and b {b.shape} must have the same first axis")
    # ggml_out_prod(B, A): ne [n, k] x [m, k] -> [n, m]  (numpy (m, n) = a^T b)
    op = "out_prod" if precision == "f32" else "out_prod_bf16"
    return g.op(op, [b2, a2], shape=(a2.shape[1], b2.shape[1]))


def out_prod(a, b, *, precision: str = "f32", backend: str | None = None):
    """Sum of outer products over the first axis: ``a.T @ b`` (wraps ggml_out_prod).

    a: (K, M) or (M,), float32; b: (K, N) or (N,), float32, float16 or bfloat16, or quantized rows
    (:class:`ops.Blocks`, K rows of N values: ggml's src0 of another type, as in MUL_MAT's
    backward pass through a frozen quantized weight). ``precision``: ``"f32"``, or ``"bf16"`` for
    float32 a and b: the backend may run it in BF16 with F32 accumulation (as :func:`mul_mat`).
    Returns float32 (M, N); for vectors, numpy.outer(a, b). Raises ValueError (shapes, precision),
    TypeError (dtypes)."""
    return apply(_out_prod, (a, b), {} if precision == "f32" else {"precision": precision}, backend)


OPERATORS.update(add=add, sub=sub, mul=mul, div=div, mul_mat=mul_mat, neg=neg)  # Tensor's +, -, *, /, @, unary -
