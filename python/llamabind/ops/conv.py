"""Convolution, im2col, pooling and upscaling, in PyTorch's NCHW/NCL layouts (numpy order)."""

from __future__ import annotations

from typing import Any

from .eager import apply
from .graph import BF16, F16, F32, Graph, Tensor, as_int, dtype_name, expect, expect_dtype, shape_to_ne, type_id


def _batched(g: Graph, data: Tensor, ndim: int) -> Tensor:
    """data with a leading batch axis of 1 if it has ndim - 1 axes."""
    if data.ndim == ndim:
        return data
    return g.op("reshape_4d", [data], shape_to_ne((1,) + data.shape), shape=(1,) + data.shape)


def _unbatched(g: Graph, out: Tensor, data: Tensor, ndim: int) -> Tensor:
    """Drop the batch axis again if the caller's data had none."""
    if data.ndim == ndim:
        return out
    return g.op("reshape_4d", [out], shape_to_ne(out.shape[1:]), shape=out.shape[1:])


def _out(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1  # ggml_calc_conv_output_size


def _im2col(
    g: Graph, kernel: Tensor, data: Tensor, stride: tuple, padding: tuple, dilation: tuple, is_2d: bool, dtype: Any
) -> Tensor:
    expect_dtype("im2col", "data", data, (F32,), g.device)
    if is_2d:
        expect(
            kernel.ndim == 4 and data.ndim in (3, 4),
            f"im2col 2D: kernel (OC, IC, KH, KW), data (N, IC, H, W); got {kernel.shape}, {data.shape}",
        )
        d4 = _batched(g, data, 4)
        oc, ic, kh, kw = kernel.shape
        n, ic2, h, w = d4.shape
        expect(ic == ic2, f"im2col: kernel has {ic} input channels, data {ic2}")
        oh, ow = _out(h, kh, stride[1], padding[1], dilation[1]), _out(w, kw, stride[0], padding[0], dilation[0])
        expect(
            oh > 0 and ow > 0,
            f"im2col: data {data.shape} is too small for kernel {kernel.shape} with these stride/padding/dilation",
        )
        shape = (n, oh, ow, ic * kh * kw)
        ints = [stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1], 1, type_id(dtype)]
        return _unbatched(g, g.op("im2col", [kernel, d4], ints=ints, shape=shape), data, 4)
    expect(
        kernel.ndim == 3 and data.ndim in (2, 3),
        f"im2col 1D: kernel (OC, IC, K), data (N, IC, L) or (IC, L); got {kernel.shape}, {data.shape}",
    )
    d3 = _batched(g, data, 3)
    _, ic, k = kernel.shape
    n, ic2, length = d3.shape
    expect(ic == ic2, f"im2col: kernel has {ic} input channels, data {ic2}")
    ol = _out(length, k, stride[0], padding[0], dilation[0])
    expect(
        ol > 0, f"im2col: data {data.shape} is too small for kernel {kernel.shape} with these stride/padding/dilation"
    )
    shape1d = (n, ol, ic * k)
    ints = [stride[0], 0, padding[0], 0, dilation[0], 0, 0, type_id(dtype)]
    return _unbatched(g, g.op("im2col", [kernel, d3], ints=ints, shape=shape1d), data, 3)


def _pair(x, name: str, n: int, lo: int) -> tuple:
    t = (x,) * n if isinstance(x, int) else tuple(x)
    expect(len(t) == n, f"{name} must be an int or {n} ints")
    # ggml order: (x/width, y/height); callers pass numpy order (height, width)
    return tuple(as_int(v, name, lo, 1 << 20) for v in reversed(t))


def im2col(
    kernel,
    data,
    stride=1,
    padding=0,
    dilation=1,
    *,
    is_2d: bool | None = None,
    dtype="float32",
    backend: str | None = None,
):
    """Patches of data for a convolution with kernel's shape (wraps ggml_im2col; kernel only
    gives the shape).

    1D: kernel (OC, IC, K), data (N, IC, L) -> (N, OL, IC*K). 2D: kernel (OC, IC, KH, KW),
    data (N, IC, H, W) -> (N, OH, OW, IC*KH*KW). The batch axis N may be left out. stride,
    padding, dilation: an int or one per spatial axis (numpy order). data: float32; dtype:
    float32 or float16 (the result). is_2d: None reads it from kernel's number of axes."""
    if is_2d is None:
        is_2d = (kernel.ndim if hasattr(kernel, "ndim") else len(kernel.shape)) == 4
    n = 2 if is_2d else 1
    expect(dtype_name(dtype) in ("float32", "float16"), "im2col: dtype must be float32 or float16")
    return apply(
        _im2col,
        (kernel, data),
        {
            "stride": _pair(stride, "stride", n, 1),
            "padding": _pair(padding, "padding", n, 0),
            "dilation": _pair(dilation, "dilation", n, 1),
            "is_2d": bool(is_2d),
            "dtype": dtype_name(dtype),
        },
        backend,
    )


def _conv_1d(g: Graph, kernel: Tensor, data: Tensor, stride: int, padding: int, dilation: int) -> Tensor:
    expect_dtype("conv_1d", "kernel", kernel, tuple(d for d in (F32, F16, BF16) if d is not None), g.device)
    expect_dtype("conv_1d", "data", data, (F32,), g.device)
    expect(
        kernel.ndim == 3 and data.ndim in (2, 3),
        f"conv_1d: kernel (OC, IC, K), data (N, IC, L); got {kernel.shape}, {data.shape}",
    )
    d3 = _batched(g, data, 3)
    oc, ic, k = kernel.shape
    expect(ic == d3.shape[1], f"conv_1d: kernel has {ic} input channels, data {d3.shape[1]}")
    ol = _out(d3.shape[2], k, stride, padding, dilation)
    expect(ol > 0, f"conv_1d: data {data.shape} is too small for kernel {kernel.shape}")
    shape = (d3.shape[0], oc, ol)
    return _unbatched(g, g.op("conv_1d", [kernel, d3], ints=[stride, padding, dilation], shape=shape), data, 3)


def conv_1d(kernel, data, stride: int = 1, padding: int = 0, dilation: int = 1, *, backend: str | None = None):
    """1-D convolution (cross-correlation, as PyTorch's conv1d) via im2col + mul_mat (wraps
    ggml_conv_1d). kernel: (OC, IC, K) float32/float16/bfloat16; data: (N, IC, L) or (IC, L)
    float32; stride, padding, dilation: ints, as PyTorch's. Returns float32 (N, OC, OL). ggml computes
    the patches in float16 (bfloat16 kernels:
    float32), so expect float16-level rounding."""
    return apply(
        _conv_1d,
        (kernel, data),
        {
            "stride": as_int(stride, "stride", 1),
            "padding": as_int(padding, "padding", 0),
            "dilation": as_int(dilation, "dilation", 1),
        },
        backend,
    )


def _conv_2d(g: Graph, kernel: Tensor, data: Tensor, stride: tuple, padding: tuple, dilation: tuple) -> Tensor:
    expect_dtype("conv_2d", "kernel", kernel, tuple(d for d in (F32, F16, BF16) if d is not None), g.device)
    expect_dtype("conv_2d", "data", data, (F32,), g.device)
    expect(
        kernel.ndim == 4 and data.ndim in (3, 4),
        f"conv_2d: kernel (OC, IC, KH, KW), data (N, IC, H, W); got {kernel.shape}, {data.shape}",
    )
    d4 = _batched(g, data, 4)
    oc, ic, kh, kw = kernel.shape
    n, ic2, h, w = d4.shape
    expect(ic == ic2, f"conv_2d: kernel has {ic} input channels, data {ic2}")
    oh, ow = _out(h, kh, stride[1], padding[1], dilation[1]), _out(w, kw, stride[0], padding[0], dilation[0])
    expect(oh > 0 and ow > 0, f"conv_2d: data {data.shape} is too small for kernel {kernel.shape}")
    shape = (n, oc, oh, ow)
    ints = [stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1]]
    return _unbatched(g, g.op("conv_2d", [kernel, d4], ints=ints, shape=shape), data, 4)


def conv_2d(kernel, data, stride=1, padding=0, dilation=1, *, backend: str | None = None):
    """2-D convolution (PyTorch's conv2d) via im2col + mul_mat (wraps ggml_conv_2d).
    kernel: (OC, IC, KH, KW) float32/float16/bfloat16; data: (N, IC, H, W) or (IC, H, W) float32;
    stride, padding, dilation: int or (h, w). Returns float32 (N, OC, OH, OW)."""
    return apply(
        _conv_2d,
        (kernel, data),
        {
            "stride": _pair(stride, "stride", 2, 1),
            "padding": _pair(padding, "padding", 2, 0),
            "dilation": _pair(dilation, "dilation", 2, 1),
        },
        backend,
    )


def _conv_transpose_1d(g: Graph, kernel: Tensor, data: Tensor, stride: int) -> Tensor:
    expect_dtype("conv_transpose_1d", "kernel", kernel, (F32, F16), g.device)
    expect_dtype("conv_transpose_1d", "data", data, (F32,), g.device)
    expect(
        kernel.ndim == 3 and data.ndim == 2,
        f"conv_transpose_1d: kernel (IC, OC, K), data (IC, L); got {kernel.shape}, {data.shape}",
    )
    ic, oc, k = kernel.shape
    expect(data.shape[0] == ic, f"conv_transpose_1d: kernel has {ic} input channels, data {data.shape[0]}")
    ol = (data.shape[1] - 1) * stride + k
    return g.op("conv_transpose_1d", [kernel, data], ints=[stride, 0, 1], shape=(oc, ol))


def conv_transpose_1d(kernel, data, stride: int = 1, *, backend: str | None = None):
    """Transposed 1-D convolution (PyTorch's conv_transpose1d, padding 0, dilation 1; wraps
    ggml_conv_transpose_1d). kernel: (IC, OC, K) float32/float16; data: (IC, L) float32.
    Returns float32 (OC, (L - 1) * stride + K)."""
    return apply(_conv_transpose_1d, (kernel, data), {"stride": as_int(stride, "stride", 1)}, backend)


_POOL = {"max": 0, "avg": 1}


def _pool_1d(g: Graph, a: Tensor, op: str, k: int, stride: int, padding: int) -> Tensor:
    expect_dtype("pool_1d", "a", a, (F32, F16), g.device)
    expect(op in _POOL, f"pool_1d: op must be 'max' or 'avg'; got {op!r}")
    expect(padding < k, "pool_1d: padding must be smaller than the kernel")
    ol = (a.shape[-1] + 2 * padding - k) // stride + 1
    expect(ol > 0, f"pool_1d: the last axis ({a.shape[-1]}) is too short for kernel {k}")
    return g.op("pool_1d", [a], ints=[_POOL[op], k, stride, padding], shape=a.shape[:-1] + (ol,))


def pool_1d(a, op: str, kernel_size: int, stride: int | None = None, padding: int = 0, *, backend: str | None = None):
    """Max or average pooling over the last axis (wraps ggml_pool_1d). a: float32/float16
    (..., L); op: "max" or "avg"; stride defaults to kernel_size; padding on both sides. Returns float32
    (..., OL)."""
    k = as_int(kernel_size, "kernel_size", 1)
    s = k if stride is None else as_int(stride, "stride", 1)
    return apply(_pool_1d, (a,), {"op": op, "k": k, "stride": s, "padding": as_int(padding, "padding", 0)}, backend)


def _pool_2d(g: Graph, a: Tensor, op: str, k: tuple, stride: tuple, padding: tuple) -> Tensor:
    expect_dtype("pool_2d", "a", a, (F32, F16), g.device)
    expect(op in _POOL, f"pool_2d: op must be 'max' or 'avg'; got {op!r}")
    expect(a.ndim >= 2, f"pool_2d: a must have at least 2 axes; got {a.shape}")
    expect(padding[0] < k[0] and padding[1] < k[1], "pool_2d: padding must be smaller than the kernel")
    ow = (a.shape[-1] + 2 * padding[0] - k[0]) // stride[0] + 1
    oh = (a.shape[-2] + 2 * padding[1] - k[1]) // stride[1] + 1
    expect(oh > 0 and ow > 0, f"pool_2d: a {a.shape} is too small for kernel {k[::-1]}")
    return g.op(
        "pool_2d",
        [a],
        ints=[_POOL[op], k[0], k[1], stride[0], stride[1]],
        floats=[padding[0], padding[1]],
        shape=a.shape[:-2] + (oh, ow),
    )


def pool_2d(a, op: str, kernel_size, stride=None, padding=0, *, backend: str | None = None):
    """Max or average pooling over the last two axes (wraps ggml_pool_2d). a: float32/float16
    (..., H, W); op: "max" or "avg"; kernel_size, stride (default kernel_size), padding: int or (h, w). float32 out."""
    k = _pair(kernel_size, "kernel_size", 2, 1)
    s = k if stride is None else _pair(stride, "stride", 2, 1)
    return apply(_pool_2d, (a,), {"op": op, "k": k, "stride": s, "padding": _pair(padding, "padding", 2, 0)}, backend)


_SCALE_MODES = {"nearest": 0, "bilinear": 1}


def _upscale(g: Graph, a: Tensor, size: tuple, mode: str, align_corners: bool) -> Tensor:
    expect_dtype("upscale", "a", a, (F32,), g.device)
    expect(mode in _SCALE_MODES, f"upscale: mode must be 'nearest' or 'bilinear'; got {mode!r}")
    expect(a.ndim >= 2, f"upscale: a must have at least 2 axes (..., H, W); got {a.shape}")
    shape = a.shape[:-2] + size
    flags = _SCALE_MODES[mode] | ((1 << 8) if align_corners else 0)
    return g.op("interpolate", [a], ints=shape_to_ne(shape) + [flags], shape=shape)


def upscale(
    a,
    size=None,
    scale_factor: int | None = None,
    mode: str = "nearest",
    align_corners: bool = False,
    *,
    backend: str | None = None,
):
    """Resize the last two axes to ``size`` (h, w), or by an integer ``scale_factor`` (wraps
    ggml_interpolate). mode: "nearest" or "bilinear" (align_corners as in PyTorch). a: float32."""
    shape = a.shape if hasattr(a, "shape") else None
    if (size is None) == (scale_factor is None):
        raise ValueError("upscale: give exactly one of size and scale_factor")
    if size is None:
        if shape is None or len(shape) < 2:
            raise ValueError("upscale: a must have at least 2 axes")
        f = as_int(scale_factor, "scale_factor", 1, 1 << 12)
        size = (shape[-2] * f, shape[-1] * f)
    size = tuple(as_int(s, "size", 1, 1 << 20) for s in size)
    expect(len(size) == 2, "upscale: size must be (h, w)")
    return apply(_upscale, (a,), {"size": size, "mode": mode, "align_corners": bool(align_corners)}, backend)


__all__ = ["im2col", "conv_1d", "conv_2d", "conv_transpose_1d", "pool_1d", "pool_2d", "upscale"]
