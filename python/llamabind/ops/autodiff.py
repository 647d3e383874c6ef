"""Gradients of functions built from llamabind.ops, by ggml's backward graph
(ggml_build_backward_expand): :func:`grad` and :func:`vjp`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .array import DeviceArray
from .graph import F32, Executable, Graph, Tensor, as_array, axis_index, dtype_name, resolve_device
from .math import mul, sum

__all__ = ["grad", "vjp"]


def _arg(x: Any) -> Any:
    """x as a graph input value: a DeviceArray as it is, anything else as a numpy array."""
    return x if isinstance(x, DeviceArray) else as_array(x)


def _device(arrays: Sequence[Any], backend: str | None) -> str:
    """The device to differentiate on: the DeviceArrays' (as an op given them runs there), else
    ``backend``'s. ValueError for DeviceArrays on another device than the others or backend."""
    on = {a.device for a in arrays if isinstance(a, DeviceArray)}
    device = resolve_device(backend) if backend is not None or not on else next(iter(on))
    if on - {device}:
        raise ValueError(
            f"DeviceArrays on {sorted(on)} and the device {device}: gradients run on one device; move them "
            f"with ops.to_device(a, {device!r})"
        )
    return device


def _trace(f: Callable, xs: Sequence[Any], argnums: Sequence[int], device: str, cotangent_shape=None):
    """Build f's graph with the inputs at argnums as float32 parameters."""
    arrays = [_arg(x) for x in xs]
    for i in argnums:
        if arrays[i].dtype != F32:
            raise TypeError(f"argument {i}: gradients need float32 inputs; got {dtype_name(arrays[i].dtype)}")
    g = Graph(device, max_nodes=1024)
    ins = [g.input(shape=a.shape, dtype=a.dtype) for a in arrays]
    with g:
        y = f(*ins)
    if not isinstance(y, Tensor) or y.graph is not g:
        raise TypeError("the function must return the result of an llamabind.ops op on its arguments")
    return g, ins, arrays, y


def _all_inputs(g: Graph, ins: Sequence[Tensor], arrays: Sequence[np.ndarray]) -> tuple[list[Tensor], list[np.ndarray]]:
    """Every input of g (the function's arguments, then constants captured while tracing) and
    the arrays to upload for them."""
    given = {t.id: a for t, a in zip(ins, arrays)}
    inputs = g.inputs
    values = [given[t.id] if t.id in given else g.value_of(t) for t in inputs]
    missing = [t for t, v in zip(inputs, values) if v is None]
    if missing:
        raise ValueError(f"inputs without a value: {missing}")
    return inputs, values  # type: ignore[return-value]


def _argnums(argnums, n) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    return tuple(axis_index(i, n, "argnums") for i in nums)


def grad(f: Callable, argnums: int | Sequence[int] = 0, *, backend: str | None = None) -> Callable:
    """Gradient of a scalar-valued function of float32 arrays, by ggml's backward graph.

    ``f`` takes arrays and returns a scalar built from llamabind.ops calls (shape () or (1,)).
    ``grad(f)(*xs)`` returns df/dxs[argnums] (a tuple when argnums is a sequence), each with
    the shape of its argument: numpy arrays, or DeviceArrays on their device when an argument is
    a :class:`DeviceArray` (e.g. a torch CUDA tensor through :func:`from_dlpack`; the gradient
    then runs on that device). Wraps ggml_build_backward_expand. Raises TypeError for ops ggml
    cannot differentiate, ValueError for DeviceArrays on different devices.
    """
    cache: dict[tuple, Any] = {}

    def df(*xs):
        arrays = [_arg(x) for x in xs]
        device = _device(arrays, backend)
        nums = _argnums(argnums, len(xs))
        key = (device, nums, tuple((a.shape, a.dtype) for a in arrays))
        hit = cache.get(key)
        if hit is None:
            g, ins, _, y = _trace(f, arrays, nums, device)
            if y.size != 1 or y.dtype != F32:
                raise ValueError(
                    f"grad needs a float32 scalar function; f returned shape {y.shape} {dtype_name(y.dtype)}"
                )
            inputs, _ = _all_inputs(g, ins, arrays)
            hit = cache[key] = (Executable(g, inputs, [y], loss=y, params=[ins[i] for i in nums]), ins)
        exe, ins = hit
        out = exe.run(_all_inputs(exe.graph, ins, arrays)[1], grads=True)[1:]
        return out[0] if isinstance(argnums, int) else tuple(out)

    return df


def vjp(f: Callable, *xs, backend: str | None = None):
    """``(y, vjp_fn)``: f(*xs) and a function mapping a cotangent of y's shape to the gradients
    of sum(f(*xs) * cotangent) with respect to every x (a tuple). float32 arrays only; with a
    :class:`DeviceArray` argument, y and the gradients are DeviceArrays on its device (and the
    cotangent may be one). Wraps ggml_build_backward_expand."""
    device = _device([_arg(x) for x in xs], backend)
    nums = tuple(range(len(xs)))
    g, ins, arrays, y = _trace(f, xs, nums, device)
    if y.dtype != F32:
        raise TypeError(f"vjp needs a float32 function; f returned {dtype_name(y.dtype)}")
    ct = g.input(shape=y.shape, dtype=F32)
    with g:
        loss = sum(mul(y, ct))
    inputs, _ = _all_inputs(g, ins + [ct], arrays + [np.zeros(y.shape, np.float32)])
    exe = Executable(g, inputs, [y], loss=loss, params=ins)
    y_val = exe.run(_all_inputs(g, ins + [ct], arrays + [np.zeros(y.shape, np.float32)])[1], grads=False)[0]

    def vjp_fn(cotangent):
        c = _arg(cotangent)
        if c.shape != y.shape or c.dtype != F32:
            raise ValueError(f"cotangent must be float32 of shape {y.shape}; got {c.shape} {dtype_name(c.dtype)}")
        return tuple(exe.run(_all_inputs(g, ins + [ct], arrays + [c])[1], grads=True)[1:])

    return y_val, vjp_fn
