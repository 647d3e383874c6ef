"""Shape and data-movement ops: concat, rows, casts, views, repeat, pad."""

from __future__ import annotations

import numpy as np

from .eager import apply
from .graph import (
    ALL,
    BF16,
    F16,
    F32,
    FLOATS,
    I16,
    I32,
    I64,
    MAX_DIMS,
    Graph,
    Tensor,
    as_int,
    axis_index,
    check_dtype,
    check_shape,
    dtype_name,
    expect,
    expect_dtype,
    shape_to_ne,
    type_id,
)


def _concat(g: Graph, a: Tensor, b: Tensor, axis: int) -> Tensor:
    expect(
        a.dtype == b.dtype,
        f"concat: a and b must have the same dtype; got {dtype_name(a.dtype)} and {dtype_name(b.dtype)}",
    )
    expect(a.ndim == b.ndim, f"concat: a {a.shape} and b {b.shape} must have the same number of axes")
    ax = axis_index(axis, a.ndim)
    for i in range(a.ndim):
        expect(i == ax or a.shape[i] == b.shape[i], f"concat: shapes {a.shape} and {b.shape} differ outside axis {ax}")
    shape = tuple(a.shape[i] + b.shape[i] if i == ax else a.shape[i] for i in range(a.ndim))
    return g.op("concat", [a, b], ints=[a.ndim - 1 - ax], shape=shape)


def concat(a, b, axis: int = 0, *, backend: str | None = None):
    """``numpy.concatenate([a, b], axis)`` (wraps ggml_concat). Any dtype (same for a and b),
    same shape outside ``axis``."""
    return apply(_concat, (a, b), {"axis": axis}, backend)


def _get_rows(g: Graph, a: Tensor, idx: Tensor) -> Tensor:
    expect_dtype("get_rows", "a", a, FLOATS + (I32,), g.device)
    expect_dtype("get_rows", "idx", idx, (I32,), g.device)
    expect(a.ndim in (2, 3), f"get_rows: a must be (rows, cols) or (batch, rows, cols); got {a.shape}")
    expect(
        idx.ndim == a.ndim - 1, f"get_rows: idx must be int32 ({'batch, ' if a.ndim == 3 else ''}n); got {idx.shape}"
    )
    if a.ndim == 3:
        expect(idx.shape[0] == a.shape[0], f"get_rows: idx batch ({idx.shape[0]}) must equal a's ({a.shape[0]})")
    g.bound_check(idx, a.shape[-2], "get_rows: idx")
    return g.op("get_rows", [a, idx], shape=idx.shape + (a.shape[-1],))


def get_rows(a, idx, *, backend: str | None = None):
    """Rows ``a[idx]`` (or ``a[b, idx[b]]`` per batch) as float32 (wraps ggml_get_rows).

    a: (rows, cols) or (batch, rows, cols), float32/float16/bfloat16 (float32 out) or int32
    (int32 out); quantized rows: :func:`dequantize`. idx: int32 (n,) or (batch, n) in
    [0, rows). Raises ValueError for an index out of range."""
    return apply(_get_rows, (a, idx), {}, backend)


def _set_rows(g: Graph, dst: Tensor, idx: Tensor, src: Tensor) -> Tensor:
    expect_dtype("set_rows", "dst", dst, (F32, F16), g.device)
    expect_dtype("set_rows", "src", src, (F32, F16), g.device)
    expect_dtype("set_rows", "idx", idx, (I64, I32), g.device)
    expect(
        dst.ndim == 2 and src.ndim == 2 and idx.ndim == 1,
        f"set_rows: dst (rows, cols), idx (n,), src (n, cols); got {dst.shape}, {idx.shape}, {src.shape}",
    )
    expect(
        src.shape == (idx.shape[0], dst.shape[1]),
        f"set_rows: src must be ({idx.shape[0]}, {dst.shape[1]}); got {src.shape}",
    )
    g.bound_check(idx, dst.shape[0], "set_rows: idx")
    return g.op("set_rows", [dst, src, idx], shape=dst.shape)


def set_rows(dst, idx, src, *, backend: str | None = None):
    """A copy of dst with rows ``dst[idx[i]] = src[i]`` (wraps ggml_set_rows).

    dst: float32/float16 (rows, cols); idx: int32/int64 (n,) in [0, rows); src: float32/float16
    (n, cols), converted to dst's dtype."""
    return apply(_set_rows, (dst, idx, src), {}, backend)


_CASTS = {(x, y) for x in FLOATS for y in FLOATS} | {(F32, I32), (I32, F32)}


def _cast(g: Graph, a: Tensor, dtype: str) -> Tensor:
    to = np.dtype(dtype) if dtype != "bfloat16" else BF16
    if (a.dtype, to) not in _CASTS:
        raise TypeError(
            f"cast: ggml cannot convert {dtype_name(a.dtype)} to {dtype_name(to)} on backend {g.device}; "
            "supported: between float32/float16/bfloat16, and float32 <-> int32"
        )
    return g.op("cast", [a], ints=[type_id(to)], shape=a.shape)


def cast(a, dtype, *, backend: str | None = None):
    """a converted to dtype (wraps ggml_cast): between float32, float16 and bfloat16, and
    float32 <-> int32 (float to int truncates toward zero, like numpy astype)."""
    check_dtype(dtype)
    return apply(_cast, (a,), {"dtype": dtype_name(dtype)}, backend)


def _transpose(g: Graph, a: Tensor) -> Tensor:
    expect(a.ndim >= 2, f"transpose: a must have at least 2 axes; got {a.shape}")
    return g.op("transpose", [a], shape=a.shape[:-2] + (a.shape[-1], a.shape[-2]), contiguous_srcs=False)


def transpose(a, *, backend: str | None = None):
    """Swap the last two axes (wraps ggml_transpose, a view; made contiguous when returned)."""
    return apply(_transpose, (a,), {}, backend)


def _permute(g: Graph, a: Tensor, axes: tuple[int, ...]) -> Tensor:
    n = a.ndim
    expect(len(axes) == n, f"permute: axes {axes} must list each of the {n} axes once")
    axes = tuple(axis_index(x, n, "axes[i]") for x in axes)
    expect(sorted(axes) == list(range(n)), f"permute: axes {axes} must be a permutation of 0..{n - 1}")
    # numpy: out axis j <- input axis axes[j]; ggml_permute: input dim d -> output dim p[d]
    p = list(range(MAX_DIMS))
    for j, src in enumerate(axes):
        p[n - 1 - src] = n - 1 - j
    return g.op("permute", [a], ints=p, shape=tuple(a.shape[i] for i in axes), contiguous_srcs=False)


def permute(a, axes, *, backend: str | None = None):
    """``numpy.transpose(a, axes)`` (wraps ggml_permute, a view; made contiguous when returned)."""
    return apply(_permute, (a,), {"axes": tuple(axes)}, backend)


def _reshape(g: Graph, a: Tensor, shape: tuple[int, ...]) -> Tensor:
    shape = tuple(shape)
    if -1 in shape:
        expect(shape.count(-1) == 1, "reshape: at most one -1")
        known = int(np.prod([s for s in shape if s != -1]))
        expect(known > 0 and a.size % known == 0, f"reshape: cannot reshape {a.shape} into {shape}")
        shape = tuple(a.size // known if s == -1 else s for s in shape)
    check_shape(shape)
    expect(int(np.prod(shape)) == a.size, f"reshape: cannot reshape {a.shape} ({a.size} elements) into {shape}")
    return g.op("reshape_4d", [a], ints=shape_to_ne(shape), shape=shape)


def reshape(a, shape, *, backend: str | None = None):
    """a with a new shape of the same size, numpy order, one -1 allowed (wraps ggml_reshape_4d)."""
    return apply(_reshape, (a,), {"shape": tuple(as_int(s, "shape[i]", -1) for s in shape)}, backend)


def _cont(g: Graph, a: Tensor) -> Tensor:
    return g.op("cont", [a], shape=a.shape)


def cont(a, *, backend: str | None = None):
    """A contiguous copy (wraps ggml_cont); in a graph, materializes a transpose/permute view."""
    return apply(_cont, (a,), {}, backend)


def _repeat(g: Graph, a: Tensor, shape: tuple[int, ...]) -> Tensor:
    # int64 is not implemented by ggml-cpu's repeat (its case is commented out upstream)
    expect_dtype("repeat", "a", a, tuple(d for d in (F32, F16, BF16, I16, I32) if d is not None), g.device)
    check_shape(shape)
    expect(len(shape) >= a.ndim, f"repeat: shape {shape} has fewer axes than a {a.shape}")
    src = (1,) * (len(shape) - a.ndim) + a.shape
    expect(all(t % s == 0 for s, t in zip(src, shape)), f"repeat: each of {shape} must be a multiple of {src}")
    return g.op("repeat_4d", [a], ints=shape_to_ne(shape), shape=tuple(shape))


def repeat(a, shape, *, backend: str | None = None):
    """a tiled to ``shape`` (each axis a multiple of a's; numpy.tile semantics) (wraps
    ggml_repeat_4d). dtypes float32/float16/bfloat16/int16/int32."""
    return apply(_repeat, (a,), {"shape": tuple(as_int(s, "shape[i]", 1) for s in shape)}, backend)


def _pad(g: Graph, a: Tensor, pad_width: tuple) -> Tensor:
    expect_dtype("pad", "a", a, (F32,), g.device)
    expect(len(pad_width) == a.ndim, f"pad: pad_width needs one (before, after) pair per axis ({a.ndim})")
    ints = [0] * 8
    for ax, (lo, hi) in enumerate(pad_width):
        d = a.ndim - 1 - ax
        ints[2 * d], ints[2 * d + 1] = lo, hi
    shape = tuple(n + lo + hi for n, (lo, hi) in zip(a.shape, pad_width))
    return g.op("pad_ext", [a], ints=ints, shape=shape)


def pad(a, pad_width, *, backend: str | None = None):
    """Zero padding, ``numpy.pad(a, pad_width)`` with ((before, after), ...) per axis (wraps
    ggml_pad_ext). a: float32."""
    pw = []
    for p in pad_width:
        lo, hi = p
        pw.append((as_int(lo, "pad_width", 0, 1 << 24), as_int(hi, "pad_width", 0, 1 << 24)))
    return apply(_pad, (a,), {"pad_width": tuple(pw)}, backend)


__all__ = ["concat", "get_rows", "set_rows", "cast", "transpose", "permute", "reshape", "cont", "repeat", "pad"]
_ = ALL
