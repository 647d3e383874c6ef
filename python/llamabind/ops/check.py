"""Backend comparison as upstream's test-backend-ops does it: :func:`nmse` and :func:`check`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

__all__ = ["nmse", "check"]


def nmse(out: np.ndarray, ref: np.ndarray) -> float:
    """Normalized mean squared error, as upstream's test-backend-ops: sum((out-ref)^2)/sum(ref^2)."""
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    den = float(np.sum(r * r))
    num = float(np.sum((o - r) ** 2))
    return num / den if den > 0 else num


def check(op: Callable, *inputs, backend: str | None = None, reference: str = "cpu", **params) -> float:
    """Run ``op(*inputs, **params)`` on ``backend`` and on ``reference`` (CPU) and return the NMSE
    between them (test-backend-ops' metric; its default limit is 1e-7)."""
    out = op(*inputs, backend=backend, **params)
    ref = op(*inputs, backend=reference, **params)
    return nmse(out, ref)
