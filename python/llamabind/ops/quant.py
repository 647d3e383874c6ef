"""Quantize and dequantize rows in ggml's block formats: the legacy types (Q4_0 ... Q8_0, Q1_0,
Q2_0), the K-quants, IQ4_NL/IQ4_XS, TQ1_0/TQ2_0, MXFP4 and NVFP4."""

from __future__ import annotations

import numpy as np

from .. import _core
from .eager import apply
from .graph import _TYPES, F32, Blocks, Graph, Tensor, as_array, expect

# the block types ggml_quantize_chunk fills without an importance matrix and without aborting on
# any finite input: IQ2_XXS, IQ2_XS and IQ1_S need an importance matrix, and the grid searches of
# IQ3_XXS, IQ3_S, IQ2_S and IQ1_M abort (GGML_ASSERT(grid_index >= 0)) on values near float32's
# range, so they are left out
QUANT_TYPES = (
    "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q1_0", "q2_0",
    "q2_K", "q3_K", "q4_K", "q5_K", "q6_K",
    "iq4_nl", "iq4_xs", "tq1_0", "tq2_0", "mxfp4", "nvfp4",
)  # fmt: skip

__all__ = ["quantize", "dequantize", "as_blocks", "row_size", "QUANT_TYPES"]


def _qtype(type: str) -> tuple[int, int, int]:
    if type not in QUANT_TYPES:
        raise ValueError(f"type must be one of {', '.join(QUANT_TYPES)}; got {type!r}")
    tid, blck, size, _ = _TYPES[type]
    return tid, blck, size


def row_size(type: str, n: int) -> int:
    """Bytes of one row of n values of ggml type ``type`` ("q4_0", "f16", ...; ggml_row_size)."""
    _, blck, size = _qtype(type)
    expect(n % blck == 0, f"{type}: the row length ({n}) must be a multiple of the block size {blck}")
    return n // blck * size


def quantize(x, type: str) -> np.ndarray:
    """Quantize float32 rows into ggml's ``type`` blocks, on the host (wraps ggml_quantize_chunk).

    x: float32 (rows, n) or (n,), n a multiple of the type's block size (32 for the legacy types,
    IQ4_NL and MXFP4; 64 for NVFP4 and Q2_0; 128 for Q1_0; 256 for the others; ``row_size`` checks).
    Returns uint8 (rows, row_size(type, n)) — the exact bytes ggml stores in a GGUF tensor."""
    a = as_array(x)
    if a.dtype != F32:
        raise TypeError(f"quantize: x must be float32; got {a.dtype}")
    a2 = a.reshape(1, -1) if a.ndim == 1 else a
    expect(a2.ndim == 2, f"quantize: x must be 1-D or 2-D; got {a.shape}")
    expect(np.isfinite(a2).all(), "quantize: x must be finite")
    out = np.empty((a2.shape[0], row_size(type, a2.shape[1])), np.uint8)
    _core.quantize_rows(_TYPES[type][0], np.ascontiguousarray(a2), out)
    return out


def as_blocks(x, type: str) -> Blocks:
    """float32 rows (rows, n) quantized into ggml's ``type`` blocks as an op argument: a
    :class:`Blocks` standing for (rows, n) values, e.g. a frozen weight for ``ops.mul_mat(w, x)``
    (wraps ggml_quantize_chunk). Raises ValueError for x not 2-D, n not a multiple of the type's
    block (see :func:`quantize`) or an unknown type, TypeError for x not float32."""
    a = as_array(x)
    expect(a.ndim == 2, f"as_blocks: x must be 2-D (rows, n); got {a.shape}")
    return Blocks(quantize(a, type), type, a.shape)


def _dequantize(g: Graph, q: Tensor, idx: Tensor) -> Tensor:
    return g.op("get_rows", [q, idx], shape=q.shape)


def dequantize(q, type: str, n: int | None = None, *, backend: str | None = None) -> np.ndarray:
    """float32 (rows, n) values of quantized rows (wraps ggml_get_rows on a ``type`` tensor, on
    ``backend``). q: uint8 (rows, row_size) as returned by :func:`quantize`; n defaults to what
    the row size implies."""
    _, blck, size = _qtype(type)
    if not isinstance(q, np.ndarray) or q.dtype != np.uint8 or q.ndim != 2:
        raise TypeError("dequantize: q must be a uint8 array (rows, row_size), as quantize() returns")
    rows, nbytes = q.shape
    expect(
        rows >= 1 and nbytes % size == 0,
        f"dequantize: rows of {nbytes} bytes are not whole {type} blocks ({size} bytes)",
    )
    n_implied = nbytes // size * blck
    n = n_implied if n is None else int(n)
    expect(n == n_implied, f"dequantize: rows of {nbytes} bytes hold {n_implied} values, not {n}")
    blocks = Blocks(np.ascontiguousarray(q), type, (rows, n))
    return apply(_dequantize, (blocks, np.arange(rows, dtype=np.int32)), {}, backend)
