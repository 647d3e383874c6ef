"""llamabind.ops: single ggml ops on numpy arrays, on any backend of the build, forward and backward.

    >>> import numpy as np
    >>> from llamabind import ops
    >>> ops.mul_mat(np.ones((2, 3), np.float32), np.ones((3, 4), np.float32))   # numpy a @ b
    >>> ops.check(ops.silu, np.random.randn(64, 64).astype(np.float32), backend="cuda")  # NMSE vs CPU

Shapes are numpy's (at most 4 axes; ggml's ne[0] is numpy's last axis). Every op takes
``backend=`` ("cpu", "cuda", "cuda:1", "metal" or a device name from :func:`devices`);
:func:`default_backend` sets the default. Inside ``with ops.graph() as g:`` ops are lazy and
``g.compute(...)`` runs them as one ggml graph. :func:`grad` and :func:`vjp` use ggml's backward
graph. Misuse raises ValueError or TypeError before ggml sees it.

Modules, importing downward only: array (DeviceArray, DLPack) <- graph (tensors, graphs, devices)
<- eager (the eager-call cache, to_device) <- math, nn, shape, conv, quant (the ops) <- autodiff
(grad, vjp), check (NMSE) <- this package.
"""

from .array import DeviceArray, from_dlpack
from .autodiff import grad, vjp
from .check import check, nmse
from .conv import conv_1d, conv_2d, conv_transpose_1d, im2col, pool_1d, pool_2d, upscale
from .eager import clear_cache, to_device
from .graph import Blocks, Graph, Tensor, default_backend, devices, graph
from .math import (
    abs,
    add,
    argmax,
    clamp,
    div,
    exp,
    gelu,
    log,
    mean,
    mul,
    mul_mat,
    neg,
    out_prod,
    relu,
    scale,
    sigmoid,
    silu,
    silu_back,
    sqr,
    sqrt,
    sub,
    sum,
    sum_rows,
    swiglu,
    tanh,
)
from .nn import (
    ROPE_MODES,
    arange,
    argsort,
    cross_entropy_loss,
    cross_entropy_loss_back,
    flash_attn_ext,
    group_norm,
    l2_norm,
    norm,
    rms_norm,
    rms_norm_back,
    rope,
    rope_back,
    soft_max,
    soft_max_back,
    timestep_embedding,
    top_k,
)
from .quant import QUANT_TYPES, as_blocks, dequantize, quantize, row_size
from .shape import cast, concat, cont, get_rows, pad, permute, repeat, reshape, set_rows, transpose

__all__ = [
    "Blocks",
    "DeviceArray",
    "Graph",
    "QUANT_TYPES",
    "ROPE_MODES",
    "Tensor",
    "abs",
    "add",
    "arange",
    "argmax",
    "argsort",
    "as_blocks",
    "cast",
    "check",
    "clamp",
    "clear_cache",
    "concat",
    "cont",
    "conv_1d",
    "conv_2d",
    "conv_transpose_1d",
    "cross_entropy_loss",
    "cross_entropy_loss_back",
    "default_backend",
    "dequantize",
    "devices",
    "div",
    "exp",
    "flash_attn_ext",
    "from_dlpack",
    "gelu",
    "get_rows",
    "grad",
    "graph",
    "group_norm",
    "im2col",
    "l2_norm",
    "log",
    "mean",
    "mul",
    "mul_mat",
    "neg",
    "nmse",
    "norm",
    "out_prod",
    "pad",
    "permute",
    "pool_1d",
    "pool_2d",
    "quantize",
    "relu",
    "repeat",
    "reshape",
    "rms_norm",
    "rms_norm_back",
    "rope",
    "rope_back",
    "row_size",
    "scale",
    "set_rows",
    "sigmoid",
    "silu",
    "silu_back",
    "soft_max",
    "soft_max_back",
    "sqr",
    "sqrt",
    "sub",
    "sum",
    "sum_rows",
    "swiglu",
    "tanh",
    "timestep_embedding",
    "to_device",
    "top_k",
    "transpose",
    "upscale",
    "vjp",
]

# every op's ``backend=`` keyword, said once here and shown in each op's own docstring (the API reference)
_BACKEND_DOC = (
    'backend: the device it runs on: "cpu", "cuda", "cuda:1", "vulkan", "metal" or a name from '
    ":func:`devices` (None: the one :func:`default_backend` set, else the CPU). ValueError for an unknown one."
)


def _document_backend() -> None:
    import inspect
    import re

    for name in __all__:
        fn = globals()[name]
        if not inspect.isfunction(fn) or "backend" not in inspect.signature(fn).parameters:
            continue
        doc = inspect.cleandoc(fn.__doc__ or "")
        if not re.search(r"\bbackend\b", doc):
            fn.__doc__ = f"{doc}\n\n{_BACKEND_DOC}"


_document_backend()
