"""The machinery behind llamabind.ops: dtypes, devices, symbolic tensors, graphs and the
eager-call cache. Gradients are in :mod:`.autodiff`, backend comparison in :mod:`.check`.

Every op is written once, as a *builder* that takes symbolic :class:`Tensor` s and validates
them. Called on numpy arrays outside a graph, an op runs eagerly: a graph of that one op is
built, compiled for the arguments' shapes and dtypes and cached, so repeated calls only upload,
compute and download.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _core
from .._validate import as_float, as_int, expect
from ..build import devices  # one list for models and ops (RPC devices included)
from .array import OPERATORS, ArrayOps, DeviceArray, bfloat16, dtype_name

__all__ = [
    "Graph",
    "Tensor",
    "Blocks",
    "graph",
    "default_backend",
    "devices",
    "resolve_device",
    "as_array",
    "as_float",
    "as_int",
    "expect",
    "OPERATORS",
]

_TYPES = _core.ggml_types()  # name -> (id, block size, bytes per block, quantized)
_ID2NAME: dict[int, str] = {v[0]: k for k, v in _TYPES.items()}

# numpy dtype <-> ggml type name
_NP2GGML: dict[np.dtype, str] = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float16): "f16",
    np.dtype(np.int8): "i8",
    np.dtype(np.int16): "i16",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
}
if bfloat16 is not None:
    _NP2GGML[bfloat16] = "bf16"
_GGML2NP: dict[str, np.dtype] = {v: k for k, v in _NP2GGML.items()}

F32, F16, I8, I16, I32, I64 = (np.dtype(t) for t in (np.float32, np.float16, np.int8, np.int16, np.int32, np.int64))
BF16 = bfloat16
FLOATS = tuple(t for t in (F32, F16, BF16) if t is not None)
ALL = FLOATS + (I8, I16, I32, I64)

MAX_DIMS = 4


def type_id(dtype: np.dtype) -> int:
    return _TYPES[_NP2GGML[np.dtype(dtype)]][0]


# ---------------------------------------------------------------------------------------------
# devices


_default_backend: contextvars.ContextVar[str] = contextvars.ContextVar("llamabind_ops_backend", default="cpu")


def resolve_device(backend: str | None) -> str:
    """Device name for ``backend``: "cpu", "cuda", "cuda:1", "metal", "vulkan", or a device name
    as listed by :func:`devices` (e.g. "CUDA0"). None means the current default."""
    if backend is None:
        backend = _default_backend.get()
    hit = _resolved.get(backend) if isinstance(backend, str) else None
    if hit is not None:  # every eager op call resolves its backend: keep the device scan off that path
        return hit
    if not isinstance(backend, str) or not backend:
        raise TypeError(f"backend must be a non-empty str such as 'cpu' or 'cuda:0'; got {backend!r}")
    _resolved[backend] = name = _resolve_uncached(backend)
    return name


_resolved: dict[str, str] = {}


def _resolve_uncached(backend: str) -> str:
    devs = devices()
    names = [d["name"] for d in devs]
    if backend in names:
        return backend
    kind, _, idx = backend.lower().partition(":")
    if idx and not idx.isdigit():
        raise ValueError(f"backend {backend!r}: the device index must be an integer")
    if kind == "cpu":
        matches = [d["name"] for d in devs if d["type"] == "cpu"]
    else:
        aliases = {
            "metal": ("mtl", "metal"),
            "cuda": ("cuda",),
            "vulkan": ("vulkan",),
            "rpc": ("rpc",),
            "sycl": ("sycl",),
            "opencl": ("opencl",),
        }
        prefixes = aliases.get(kind, (kind,))
        matches = [
            d["name"]
            for d in devs
            if d["backend"].lower().startswith(prefixes) or d["name"].lower().startswith(prefixes)
        ]
    i = int(idx) if idx else 0
    if i >= len(matches):
        raise ValueError(f"no backend device {backend!r} in this build; devices: {', '.join(names)}")
    return matches[i]


@contextlib.contextmanager
def default_backend(backend: str):
    """Context manager: ops called without ``backend=`` inside it run on ``backend``."""
    token = _default_backend.set(resolve_device(backend))
    try:
        yield
    finally:
        _default_backend.reset(token)


# ---------------------------------------------------------------------------------------------
# symbolic tensors and graphs


def shape_to_ne(shape: tuple[int, ...]) -> list[int]:
    ne = [int(n) for n in reversed(shape)]
    return ne + [1] * (MAX_DIMS - len(ne))


class Tensor(ArrayOps):
    """A node of a :class:`Graph`: the lazy result of an op. Shape in numpy order; the operators
    + - * / @ and unary - apply the ops (:class:`ArrayOps`). Made by the graph's ops: ``graph``, ``id``
    (its node), ``shape``, ``dtype`` and ``contiguous`` (whether its memory is)."""

    __slots__ = ("graph", "id", "shape", "dtype", "contiguous", "bound", "ggml_type")

    def __init__(self, graph: Graph, id: int, shape: tuple[int, ...], dtype: np.dtype, contiguous: bool = True):
        self.graph, self.id, self.shape, self.dtype, self.contiguous = graph, id, shape, dtype, contiguous
        self.bound: int | None = None  # int tensors: all values are known to lie in [0, bound)
        self.ggml_type: str | None = None  # quantized inputs (Blocks): the ggml type name, e.g. "q4_0"

    def __repr__(self) -> str:
        return f"<ops.Tensor #{self.id} {self.shape} {dtype_name(self.dtype)} on {self.graph.device}>"


class Blocks:
    """Quantized rows as an op argument: ``data`` uint8 (rows, row bytes) in the blocks of the
    ggml type ``dtype`` (e.g. "q4_0"), standing for float values of numpy ``shape`` (rows, n). A
    graph input made from it has that ggml type (:meth:`Graph.input`); its bytes are uploaded as
    they are (``__array__`` gives ``data``). See :func:`llamabind.ops.dequantize`."""

    __slots__ = ("data", "dtype", "shape")

    def __init__(self, data: np.ndarray, dtype: str, shape: tuple[int, ...]):
        self.data, self.dtype, self.shape = data, dtype, tuple(shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.data

    @property
    def _lb_bytes(self) -> np.ndarray:  # what Graph.run uploads (graph_run.cpp)
        return self.data


_current_graph: contextvars.ContextVar[Graph | None] = contextvars.ContextVar("llamabind_ops_graph", default=None)


_VIEW_OK = {"cont", "transpose", "permute", "cpy"}  # ops that take non-contiguous sources


class Graph:
    """A lazy chain of ops run as one ggml graph on one backend device.

        with ops.graph("cpu") as g:
            y = ops.silu(ops.mul_mat(w, x))     # numpy arrays become inputs of g
        out = g.compute(y)                      # numpy array

    Inside the ``with`` block, ops return :class:`Tensor` s instead of arrays. ``compute`` builds
    and allocates the graph on first use (ggml_gallocr) and can be called again, also with new
    input values: ``g.compute(y, feed={x: new_array})``. backend: as the ops' (None: the default);
    max_nodes: the most ops the graph may hold (ggml's graph size).
    """

    def __init__(self, backend: str | None = None, max_nodes: int = 512):
        self.device = resolve_device(backend)
        self._ggml_graph = _core.Graph(self.device, max_nodes)
        self._values: dict[int, Any] = {}  # input id -> bound array (numpy, Blocks data or DeviceArray)
        self._inputs: dict[int, Tensor] = {}
        self._compiled: dict[tuple, Executable] = {}
        self._bounds: list[tuple[int, int, str]] = []  # (input id, n, what): values must lie in [0, n)
        self._token: contextvars.Token[Graph | None] | None = None

    def __enter__(self) -> Graph:
        self._token = _current_graph.set(self)
        return self

    def __exit__(self, *exc) -> None:
        if self._token is not None:
            _current_graph.reset(self._token)
            self._token = None

    # building
    def input(
        self, value: Any = None, *, shape: Sequence[int] | None = None, dtype: Any = None, ggml_type: str | None = None
    ) -> Tensor:
        """A graph input: bound to ``value`` (an array, a :class:`DeviceArray` on the graph's device,
        or :class:`Blocks` of quantized rows), or a
        placeholder of ``shape`` (numpy order) with a numpy ``dtype`` or a ggml type name
        ``ggml_type`` (e.g. "q4_0": the tensor has that type and takes raw blocks, its Tensor
        dtype is uint8). Wraps ggml_new_tensor. TypeError for a missing shape/dtype or an
        unsupported dtype, ValueError for a bad shape, an unknown ggml type, a row length that
        is not a whole number of blocks, or a DeviceArray on another device."""
        arr: Any = None
        if isinstance(value, Blocks):
            shape, ggml_type, arr = value.shape, value.dtype, value.data
        elif isinstance(value, DeviceArray):
            if value.device != self.device:
                raise ValueError(f"{value} is not on the graph's device {self.device}")
            arr, shape, dtype = value, value.shape, value.dtype
        elif value is not None:
            arr = as_array(value)
            shape, dtype = arr.shape, arr.dtype
        elif shape is None or (dtype is None) == (ggml_type is None):
            raise TypeError("give either a value, or shape and one of dtype and ggml_type")
        shape = tuple(int(n) for n in shape)
        check_shape(shape)
        if ggml_type is not None:
            expect(ggml_type in _TYPES, f"ggml_type must be a ggml type name such as 'q4_0'; got {ggml_type!r}")
            tid, blck = _TYPES[ggml_type][0], _TYPES[ggml_type][1]
            expect(shape[-1] % blck == 0, f"{ggml_type}: the row length ({shape[-1]}) must be a multiple of {blck}")
            np_dtype = np.dtype(np.uint8)
        else:
            np_dtype = np.dtype(dtype)
            check_dtype(np_dtype)
            tid = type_id(np_dtype)
        nid = self._ggml_graph.input(tid, shape_to_ne(shape))
        t = Tensor(self, nid, shape, np_dtype)
        t.ggml_type = ggml_type if ggml_type is not None and _TYPES[ggml_type][3] else None
        self._inputs[nid] = t
        if arr is not None:
            self._values[nid] = arr
        return t

    def op(
        self,
        name: str,
        srcs: Sequence[Tensor | None],
        ints: Sequence[int] = (),
        floats: Sequence[float] = (),
        *,
        shape: tuple[int, ...] | None = None,
        ndim: int | None = None,
        contiguous_srcs: bool = True,
    ) -> Tensor:
        """Append ggml op ``name`` (already validated by the caller) and return its tensor.

        srcs: its source tensors (None for an absent optional source, e.g. no mask); ints, floats: its
        integer and float op parameters, in the order the ggml function takes them. The result's
        numpy shape is ``shape`` if given, else ggml's ne read back, keeping ``ndim`` axes (default: the
        largest ndim among the sources). contiguous_srcs: make non-contiguous sources contiguous first."""
        ids = []
        for s in srcs:
            if s is None:
                ids.append(-1)
                continue
            if s.graph is not self:
                raise ValueError("all tensors of an op must belong to the same graph")
            if contiguous_srcs and not s.contiguous and name not in _VIEW_OK:
                s = self.op("cont", [s], shape=s.shape)
            ids.append(s.id)
        nid = self._ggml_graph.op(name, ids, [int(i) for i in ints], [float(f) for f in floats])
        tid, ne, contig = self._ggml_graph.info(nid)
        if shape is None:
            if ndim is None:
                ndim = max([s.ndim for s in srcs if s is not None] or [1])
            while ndim < MAX_DIMS and any(n != 1 for n in ne[ndim:]):
                ndim += 1
            shape = tuple(reversed(ne[:ndim])) if ndim else ()
        elif math.prod(shape) != math.prod(ne):
            raise AssertionError(f"{name}: numpy shape {shape} does not match ggml ne {ne}")  # a bug of ours
        dtype = _GGML2NP.get(_ID2NAME[tid]) or np.dtype(np.uint8)
        return Tensor(self, nid, tuple(shape), dtype, contig)

    def bound_check(self, idx: Tensor, n: int, what: str) -> None:
        """Index values of ``idx`` must lie in [0, n): checked at run time for graph inputs, known
        for indices that argsort/top_k/argmax produced; anything else cannot be proven safe. what:
        the argument's name for the error message."""
        if idx.id in self._inputs:
            self._bounds.append((idx.id, n, what))
        elif idx.bound is None or idx.bound > n:
            raise ValueError(
                f"{what}: indices computed inside the graph cannot be range-checked; pass them as an "
                "input array (or use argsort/top_k/argmax output of a row length <= the row count)"
            )

    @property
    def inputs(self) -> list[Tensor]:
        """The graph's inputs, in the order they were made."""
        return list(self._inputs.values())

    def value_of(self, t: Tensor) -> Any:
        """The array the input tensor ``t`` is bound to (``input(value)``), or None for a placeholder."""
        return self._values.get(t.id)

    # running
    def compute(self, *outputs: Tensor, feed: dict[Tensor, Any] | None = None, n_threads: int | None = None):
        """Values of ``outputs`` (one array if one output): numpy arrays of the outputs' shapes and
        dtypes, or DeviceArrays on the graph's device when an input is bound to a DeviceArray.
        ``feed``: new values for inputs (same shape and dtype; ValueError otherwise). Runs the
        graph with ggml_backend_graph_compute; CPU: ``n_threads`` (None: 1 for small graphs, else
        every core)."""
        if not outputs:
            raise TypeError("compute() needs at least one output tensor")
        for t in outputs:
            if not isinstance(t, Tensor) or t.graph is not self:
                raise TypeError("compute() takes tensors of this graph")
        key = tuple(t.id for t in outputs)
        exe = self._compiled.get(key)
        if exe is None:
            if self._compiled:
                raise ValueError("this graph was already built for other outputs; make a new ops.graph()")
            exe = self._compiled[key] = Executable(self, list(self._inputs.values()), list(outputs))
        values = dict(self._values)
        for t, v in (feed or {}).items():
            if t.id not in self._inputs:
                raise ValueError(f"{t} is not an input of this graph")
            arr = v if isinstance(v, DeviceArray) else as_array(v)
            if arr.shape != t.shape or arr.dtype != t.dtype:
                raise ValueError(
                    f"feed for {t}: expected shape {t.shape} {dtype_name(t.dtype)}, "
                    f"got {arr.shape} {dtype_name(arr.dtype)}"
                )
            values[t.id] = arr
        missing = [t for t in exe.inputs if t.id not in values]
        if missing:
            raise ValueError(f"no value for input(s) {missing}: pass feed={{tensor: array}}")
        out = exe.run([values[t.id] for t in exe.inputs], n_threads=n_threads)
        return out[0] if len(out) == 1 else tuple(out)


def graph(backend: str | None = None, max_nodes: int = 512) -> Graph:
    """A new lazy :class:`Graph` on ``backend`` of at most ``max_nodes`` ops (use as a context manager)."""
    return Graph(backend, max_nodes)


# ---------------------------------------------------------------------------------------------
# compiled graphs


class Executable:
    """A built, allocated graph with fixed inputs and outputs (optionally a loss and params).
    Forward graphs bind inputs and outputs to the caller's memory at each run (graph_run.cpp)."""

    def __init__(
        self,
        g: Graph,
        inputs: list[Tensor],
        outputs: list[Tensor],
        loss: Tensor | None = None,
        params: Sequence[Tensor] = (),
    ):
        self.graph = g
        self.inputs = inputs
        outs = [g.op("cont", [t], shape=t.shape) if not t.contiguous else t for t in outputs]
        self.outputs = outs
        self.params = list(params)
        g._ggml_graph.build(
            [t.id for t in inputs],
            [t.id for t in outs],
            loss.id if loss is not None else -1,
            [p.id for p in self.params],
        )
        self.out_specs = [(t.shape, t.dtype) for t in outs]
        self.native_run = g._ggml_graph.run  # _core.Graph.run(inputs, outputs, grads, n_threads)
        self.checks_bounds = bool(g._bounds)  # index inputs whose range run() checks
        work = sum(t.size for t in outs) + sum(t.size for t in inputs)
        self.n_threads = 1 if work < (1 << 16) else 0  # tiny graphs: threads cost more than they save

    def run(self, arrays: Sequence[Any], n_threads: int | None = None, grads: bool = False) -> list:
        """Outputs (then the params' gradients if ``grads``) for input ``arrays`` (numpy arrays,
        Blocks or DeviceArrays of the inputs' shapes and dtypes, in order): numpy arrays, or
        DeviceArrays on the graph's device (gradients too) when any input is a DeviceArray."""
        if self.checks_bounds:
            self._check_bounds(arrays)
        on_device = any(type(a) is DeviceArray for a in arrays)
        if on_device:
            outs: list = [DeviceArray.empty(s, d, self.graph.device) for s, d in self.out_specs]
            bufs = [o._buf for o in outs]
        else:
            outs = bufs = [np.empty(s, d) for s, d in self.out_specs]
        gs: list = []
        if grads and on_device:  # gradients stay where the arguments are
            gs = [DeviceArray.empty(p.shape, p.dtype, self.graph.device) for p in self.params]
        elif grads:
            gs = [np.empty(p.shape, p.dtype) for p in self.params]
        gbufs = [x._buf for x in gs] if on_device else gs
        self.native_run(arrays, bufs, gbufs, self.n_threads if n_threads is None else n_threads)
        return outs + gs

    def _check_bounds(self, arrays: Sequence[Any]) -> None:
        pos = {t.id: i for i, t in enumerate(self.inputs)}
        for tid, n, what in self.graph._bounds:
            a = np.asarray(arrays[pos[tid]])
            if a.size and (int(a.min()) < 0 or int(a.max()) >= n):
                raise ValueError(f"{what} values must lie in [0, {n}); got min {int(a.min())}, max {int(a.max())}")


# ---------------------------------------------------------------------------------------------
# argument handling


def as_array(x: Any) -> np.ndarray:
    """numpy array of a supported dtype (Python scalars and lists become float32/int64 arrays)."""
    if isinstance(x, np.ndarray):
        arr = x
    elif isinstance(x, (bool, np.bool_)):
        raise TypeError("bool arrays are not supported by ggml ops")
    elif isinstance(x, (float, int)) and not isinstance(x, bool):
        arr = np.asarray(x, dtype=np.float32)
    elif isinstance(x, np.generic):
        arr = np.asarray(x)
    elif isinstance(x, (list, tuple)):
        arr = np.asarray(x)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
    else:
        raise TypeError(f"expected a numpy array or an ops.Tensor, got {type(x).__name__}")
    check_dtype(arr.dtype)
    check_shape(arr.shape)
    return arr


def check_dtype(dtype) -> None:
    dt = np.dtype(dtype)
    if dt not in _NP2GGML:
        hint = " (convert float64 with .astype(np.float32))" if dt == np.float64 else ""
        names = ", ".join(dtype_name(t) for t in ALL)
        raise TypeError(f"dtype {dtype_name(dt)} is not supported by ggml ops; use one of {names}{hint}")


def check_shape(shape: tuple[int, ...]) -> None:
    if len(shape) > MAX_DIMS:
        raise ValueError(f"ggml tensors have at most {MAX_DIMS} dimensions; got shape {tuple(shape)}")
    if any(n < 1 for n in shape):
        raise ValueError(f"every dimension must be >= 1; got shape {tuple(shape)}")
    if any(n >= 2**62 for n in shape):
        raise ValueError(f"dimension too large in shape {tuple(shape)}")


def expect_dtype(op: str, name: str, t: Tensor, allowed: Sequence[np.dtype], device: str) -> None:
    """TypeError naming op, dtype and backend when ``t``'s dtype is not among ``allowed``."""
    if t.dtype not in allowed:
        names = ", ".join(dtype_name(d) for d in allowed)
        raise TypeError(
            f"{op}: {name} has dtype {dtype_name(t.dtype)}, which ggml's {op} does not support on backend "
            f"{device}; supported: {names}"
        )


def axis_index(axis: int, ndim: int, name: str = "axis") -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"{name} must be an int; got {type(axis).__name__}")
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name} {axis} is out of range for {ndim} dimensions")
    return int(axis) % ndim
