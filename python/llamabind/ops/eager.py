"""Eager op calls: an op called on arrays outside a graph builds a graph of that one op, compiled
for the arguments' types, shapes and dtypes and cached, so that a repeated call only binds its
arrays and computes (see graph_run.cpp: numpy arrays are used in place on the CPU backend)."""

from __future__ import annotations

import atexit
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import _core
from .array import DeviceArray, from_dlpack
from .graph import (
    Blocks,
    Executable,
    Graph,
    Tensor,
    _current_graph,
    _default_backend,
    _resolved,
    as_array,
    resolve_device,
)

__all__ = ["apply", "clear_cache", "to_device"]

# key -> (executable, positions of the non-None args or None, (run, out shape, out dtype, n_threads) for
# plain numpy calls or None)
_cache: dict[tuple, tuple[Executable, list[int] | None, tuple | None]] = {}
_CACHE_MAX = 512


def apply(
    builder: Callable[..., Tensor],
    args: Sequence[Any],
    params: dict[str, Any],
    backend: str | None,
):
    """Run ``builder(g, *tensors, **params)``: symbolically if any arg is a Tensor or a graph is
    active, else eagerly (cached per argument types, shapes, dtypes, params and device)."""
    if _current_graph.get() is None:  # the eager fast path: a cache hit skips every Python check
        try:  # (a hit means this builder validated these types, shapes, dtypes and params)
            if backend is not None:
                device = _resolved[backend]
            elif args and type(args[0]) is DeviceArray:  # an op runs on its DeviceArray arguments' device
                device = args[0].device
            else:
                device = _resolved[_default_backend.get()]
            key = (builder, device, tuple(params.items()) if params else (), _signature(args))
            exe, idx, plain = _cache[key]
        except (AttributeError, KeyError, TypeError):
            pass  # Python scalars and lists, Tensors, a new signature: the full path below
        else:
            if plain is not None:  # numpy in and out, no index ranges to check
                run, shape, dtype, n_threads = plain
                out = np.empty(shape, dtype)
                run(args, (out,), (), n_threads)
                return out
            return exe.run(args if idx is None else [args[i] for i in idx])[0]
    return _apply(builder, args, params, backend)


def _apply(builder: Callable[..., Tensor], args: Sequence[Any], params: dict[str, Any], backend: str | None):
    g = next((a.graph for a in args if isinstance(a, Tensor)), None) or _current_graph.get()
    if g is not None:
        if backend is not None and resolve_device(backend) != g.device:
            raise ValueError(f"backend={backend!r} differs from the graph's device {g.device}")
        ts = [a if isinstance(a, Tensor) or a is None else g.input(a) for a in args]
        return builder(g, *ts, **params)
    arrays = [_eager_arg(a) for a in args]
    on = next((a.device for a in arrays if isinstance(a, DeviceArray)), None)
    device = on if backend is None and on is not None else resolve_device(backend)  # an array's device
    for a in arrays:
        if isinstance(a, DeviceArray) and a.device != device:
            raise ValueError(
                f"{a} is not on the op's device {device}: move it with ops.to_device(a, {device!r}) or a.numpy()"
            )
    key = (builder, device, tuple(params.items()) if params else (), _signature(arrays))
    hit = _cache.get(key)
    if hit is None:
        g = Graph(device)
        ins = [None if a is None else _placeholder(g, a) for a in arrays]
        out = builder(g, *ins, **params)
        exe = Executable(g, [t for t in ins if t is not None], [out])
        if len(_cache) >= _CACHE_MAX:
            _cache.pop(next(iter(_cache)))
        given = [i for i, a in enumerate(arrays) if a is not None]
        idx = None if len(given) == len(arrays) else given
        numpy_only = idx is None and not exe.checks_bounds and DeviceArray not in map(type, arrays)
        plain = (exe.native_run, *exe.out_specs[0], exe.n_threads) if numpy_only else None
        hit = _cache[key] = (exe, idx, plain)
    exe, idx, _ = hit
    return exe.run(arrays if idx is None else [arrays[i] for i in idx])[0]


def _signature(args: Sequence[Any]) -> tuple:
    """(type, shape, dtype) of each argument, None for None; AttributeError for scalars and lists."""
    try:  # unrolled for the usual one or two arrays: half the time of the general form
        if len(args) == 2:
            a, b = args
            return ((type(a), a.shape, a.dtype), (type(b), b.shape, b.dtype))
        if len(args) == 1:
            a = args[0]
            return ((type(a), a.shape, a.dtype),)
    except AttributeError:
        pass
    return tuple([None if a is None else (type(a), a.shape, a.dtype) for a in args])


def _eager_arg(a: Any) -> Any:
    if a is None or isinstance(a, (Blocks, DeviceArray)):
        return a
    if not isinstance(a, np.ndarray) and hasattr(a, "__dlpack__") and hasattr(a, "__dlpack_device__"):
        return from_dlpack(a)  # torch/cupy/jax arrays: shared, not copied (CPU, CUDA)
    return as_array(a)


def _placeholder(g: Graph, a: np.ndarray | Blocks | DeviceArray) -> Tensor:
    if isinstance(a, Blocks):
        return g.input(shape=a.shape, ggml_type=a.dtype)
    return g.input(shape=a.shape, dtype=a.dtype)


def clear_cache() -> None:
    """Free every cached eager graph (also done at interpreter exit) and the device memory kept
    from dropped DeviceArrays for reuse."""
    _cache.clear()
    _core.free_device_buffers()


atexit.register(clear_cache)  # free the graphs before the extension is torn down


def to_device(x: Any, backend: str | None = None) -> DeviceArray:
    """Copy the array ``x`` to ``backend`` (default: the current default backend; "cuda", "CUDA0",
    "vulkan", "cpu" ...) and keep it there: a :class:`DeviceArray` of the same shape (numpy
    order, at most 4 axes) and dtype (float32, float16, bfloat16, int8/16/32/64; Python floats and
    lists become float32), copied with ggml_backend_tensor_set. A DeviceArray already on that
    device is returned as it is; one on another device goes through the host. TypeError for
    unsupported dtypes, ValueError for a bad shape or an unknown device, LlamaError when the
    device has no room."""
    device = resolve_device(backend)
    if isinstance(x, DeviceArray):
        if x.device == device:
            return x
        x = x.numpy()
    arr = np.ascontiguousarray(as_array(x))
    buf = _core.DeviceBuffer(device, arr.nbytes)
    buf.upload(arr.reshape(-1).view(np.uint8))
    return DeviceArray(buf, arr.shape, arr.dtype)
