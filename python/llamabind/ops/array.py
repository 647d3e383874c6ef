"""Arrays that stay in a backend device's memory between op calls, and DLPack in and out.

    x = ops.to_device(np_array, "cuda")         # one copy in (ops.eager.to_device)
    y = ops.silu(ops.mul_mat(w, x))             # DeviceArray in -> DeviceArray out, no copies
    y.numpy()                                   # one copy out
    t = torch.from_dlpack(y)                    # CPU/CUDA: shares the memory
    z = ops.from_dlpack(t)                      # and back, without a copy

Numpy in gives numpy out, as before; an op given a DeviceArray returns DeviceArrays on the op's
device. An op and its DeviceArray arguments must be on the same device (ValueError otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _core

__all__ = ["ArrayOps", "DeviceArray", "from_dlpack", "OPERATORS"]

# Tensor's and DeviceArray's operators -> the op functions: .math registers add, sub, mul, div,
# mul_mat, neg (the modules here sit below the op modules and do not import them).
OPERATORS: dict[str, Callable[..., Any]] = {}

try:  # bfloat16 for numpy (graph.py and the op modules take it from here)
    import ml_dtypes

    bfloat16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is optional
    ml_dtypes = None  # type: ignore[assignment]
    bfloat16 = None


def dtype_name(dtype) -> str:
    """numpy's name of a dtype, "bfloat16" for ml_dtypes' (whose numpy name is not that)."""
    return "bfloat16" if bfloat16 is not None and np.dtype(dtype) == bfloat16 else np.dtype(dtype).name


# numpy dtype <-> DLPack (type code, bits): kDLInt 0, kDLFloat 2, kDLBfloat 4
_DL: dict[np.dtype, tuple[int, int]] = {
    np.dtype(t): (0, np.dtype(t).itemsize * 8) for t in (np.int8, np.int16, np.int32, np.int64)
}
_DL.update({np.dtype(np.float16): (2, 16), np.dtype(np.float32): (2, 32)})
if bfloat16 is not None:
    _DL[bfloat16] = (4, 16)
_FROM_DL = {v: k for k, v in _DL.items()}


class ArrayOps:
    """ndim, size and the arithmetic operators shared by ops.Tensor and DeviceArray: each operator
    calls the op function registered in OPERATORS (``_op`` adds the arguments' device)."""

    __slots__ = ()
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def _op(self, name: str, *args: Any) -> Any:
        return OPERATORS[name](*args)

    def __add__(self, o: Any) -> Any:
        return self._op("add", self, o)

    def __sub__(self, o: Any) -> Any:
        return self._op("sub", self, o)

    def __mul__(self, o: Any) -> Any:
        return self._op("mul", self, o)

    def __truediv__(self, o: Any) -> Any:
        return self._op("div", self, o)

    def __matmul__(self, o: Any) -> Any:
        return self._op("mul_mat", self, o)

    def __neg__(self) -> Any:
        return self._op("neg", self)


class DeviceArray(ArrayOps):
    """An array in the memory of a ggml backend device (CUDA0, Vulkan0, CPU, RPC[...]).

    shape: numpy order, dtype: a numpy dtype (float32, float16, bfloat16, int8..int64), device:
    the ggml device name. ``numpy()`` / ``np.asarray(a)`` copy it to the host
    (ggml_backend_tensor_get); ``__dlpack__`` shares it with torch, cupy or jax on CPU and CUDA
    devices (TypeError on others). Made by :func:`to_device`, :func:`from_dlpack`, or an op that
    was given a DeviceArray (``buf``: the extension's device buffer that holds it)."""

    __slots__ = ("_buf", "shape", "dtype")  # graph_run.cpp binds ``_buf`` (a _core.DeviceBuffer)
    __array_priority__ = 100  # numpy's operators defer to ours

    def __init__(self, buf: Any, shape: tuple[int, ...], dtype: np.dtype):
        self._buf, self.shape, self.dtype = buf, tuple(shape), np.dtype(dtype)

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: np.dtype, device: str) -> DeviceArray:
        """Uninitialized memory for ``shape`` and ``dtype`` on ``device`` (a device name)."""
        return cls(_core.DeviceBuffer(device, math.prod(shape) * np.dtype(dtype).itemsize), shape, dtype)

    @property
    def device(self) -> str:
        """The backend device holding the data, as ``ops.devices()`` names it (``"CUDA0"``, ``"CPU"``)."""
        return self._buf.device

    @property
    def nbytes(self) -> int:
        """Size of the data in bytes (ggml_nbytes of the tensor)."""
        return self._buf.nbytes

    def numpy(self) -> np.ndarray:
        """A host copy: a numpy array of the same shape and dtype (ggml_backend_tensor_get)."""
        out = np.empty(self.shape, self.dtype)
        self._buf.download(out.reshape(-1).view(np.uint8))
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if copy is False:
            raise ValueError("a DeviceArray reaches numpy as a copy; use np.from_dlpack for shared memory")
        a = self.numpy()
        return a if dtype is None else a.astype(dtype, copy=False)

    def _dl(self):
        code, bits = _DL[self.dtype]
        return self._buf.dlpack(list(self.shape), code, bits)

    def __dlpack__(self, **kwargs: Any):
        return self._dl().__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._dl().__dlpack_device__()

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"<ops.DeviceArray {self.shape} {dtype_name(self.dtype)} on {self.device}>"

    def _op(self, name: str, *args: Any):
        return OPERATORS[name](*args, backend=self.device)


def from_dlpack(x: Any) -> DeviceArray:
    """A :class:`DeviceArray` sharing the memory of a C-contiguous DLPack array (torch, cupy,
    jax, numpy) on the CPU or a CUDA device: no copy; the DeviceArray keeps ``x``'s memory
    alive. Waits for the device to finish queued work first (cudaDeviceSynchronize), since
    ggml's streams do not wait for the producer's. TypeError for other devices, non-contiguous
    arrays and dtypes ggml has no type for (float64, bool, complex)."""
    if isinstance(x, DeviceArray):
        return x
    try:
        buf, shape, code, bits = _core.DeviceBuffer.from_dlpack(x)
    except TypeError as e:
        if "incompatible function arguments" not in str(e):
            raise
        raise TypeError(
            f"from_dlpack: expected a C-contiguous array that supports DLPack (__dlpack__); got {type(x).__name__}"
        ) from None
    dtype = _FROM_DL.get((code, bits))
    if dtype is None:
        raise TypeError(f"from_dlpack: no ggml type for DLPack dtype code {code}, {bits} bits")
    return DeviceArray(buf, tuple(shape), dtype)
