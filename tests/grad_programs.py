"""Random compositions of llamabind.ops for the gradient property test (tests/test_grad_compositions.py).

A program is a JSON-able list of steps ``[name, params]`` applied to one float32 input x; the loss is
``sum(y * W)`` for a fixed random W of y's shape. Every step has two implementations: llamabind.ops
(ggml, float32) and numpy (float64, written here from the ops' definitions), so the gradient ggml's
backward graph gives can be compared with central finite differences of the float64 program.

``python tests/grad_programs.py`` is the worker: it reads one JSON request per line on stdin, runs
``ops.grad`` on it and answers one JSON line; a ggml abort kills only the worker.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

C_GELU, A_GELU = np.sqrt(2 / np.pi), 0.044715
EPS = 1e-5


def _silu(x):
    return x / (1 + np.exp(-x))


def _soft_max(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _rms_norm(x):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)


def _norm(x):
    c = x - x.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + EPS)


def const(shape, seed, lo=-1.0, hi=1.0):
    """A constant operand of a step (float32, away from zero)."""
    rng = np.random.default_rng(seed)
    v = rng.uniform(lo, hi, size=shape)
    v[np.abs(v) < 0.1] = 0.5
    return v.astype(np.float32)


# name -> (numpy float64 function, llamabind function); each takes (v, params, x) where x is the
# program's input (for steps that use it a second time)
def _steps():
    from test_ops import rope_ref  # the op tests' float64 RoPE (tests/ is on sys.path for the worker too)

    from llamabind import ops

    def binary(name, npf):
        def g(v, p, x):
            other = x if p["with"] == "x" else v if p["with"] == "self" else const(p["shape"], p["seed"], 0.5, 1.5)
            return getattr(ops, name)(v, other)

        def n(v, p, x):
            other = x if p["with"] == "x" else v if p["with"] == "self" else const(p["shape"], p["seed"], 0.5, 1.5)
            return npf(v, np.asarray(other, np.float64))

        return n, g

    def causal_soft_max(v, p, x, lib):
        t, n = v.shape[-2], v.shape[-1]
        mask = np.triu(np.full((t, n), -np.inf, np.float32), 1 + n - t)
        if lib == "np":
            return _soft_max(v + mask)
        return ops.soft_max(v, mask=mask)

    return {
        "sqr": (lambda v, p, x: v * v, lambda v, p, x: ops.sqr(v)),
        "exp": (lambda v, p, x: np.exp(v), lambda v, p, x: ops.exp(v)),
        "neg": (lambda v, p, x: -v, lambda v, p, x: ops.neg(v)),
        "abs": (lambda v, p, x: np.abs(v), lambda v, p, x: ops.abs(v)),
        "relu": (lambda v, p, x: np.maximum(v, 0), lambda v, p, x: ops.relu(v)),
        "silu": (lambda v, p, x: _silu(v), lambda v, p, x: ops.silu(v)),
        "gelu": (
            lambda v, p, x: 0.5 * v * (1 + np.tanh(C_GELU * (v + A_GELU * v**3))),
            lambda v, p, x: ops.gelu(v),
        ),
        "tanh": (lambda v, p, x: np.tanh(v), lambda v, p, x: ops.tanh(v)),
        "sigmoid": (lambda v, p, x: 1 / (1 + np.exp(-v)), lambda v, p, x: ops.sigmoid(v)),
        "log1p_sqr": (lambda v, p, x: np.log(v * v + 1), lambda v, p, x: ops.log(ops.add(ops.sqr(v), 1.0))),
        "sqrt1p_sqr": (lambda v, p, x: np.sqrt(v * v + 1), lambda v, p, x: ops.sqrt(ops.add(ops.sqr(v), 1.0))),
        "scale": (lambda v, p, x: v * p["s"], lambda v, p, x: ops.scale(v, p["s"])),
        "add": binary("add", np.add),
        "sub": binary("sub", np.subtract),
        "mul": binary("mul", np.multiply),
        "div": binary("div", np.divide),
        "sum_rows": (lambda v, p, x: v.sum(-1, keepdims=True), lambda v, p, x: ops.sum_rows(v)),
        "mean": (lambda v, p, x: v.mean(-1, keepdims=True), lambda v, p, x: ops.mean(v)),
        "soft_max": (lambda v, p, x: _soft_max(v), lambda v, p, x: ops.soft_max(v)),
        "causal_soft_max": (
            lambda v, p, x: causal_soft_max(v, p, x, "np"),
            lambda v, p, x: causal_soft_max(v, p, x, "ggml"),
        ),
        "rms_norm": (lambda v, p, x: _rms_norm(v), lambda v, p, x: ops.rms_norm(v, EPS)),
        "norm": (lambda v, p, x: _norm(v), lambda v, p, x: ops.norm(v, EPS)),
        "mul_mat_right": (  # v @ C
            lambda v, p, x: v @ const((v.shape[-1], p["n"]), p["seed"]),
            lambda v, p, x: ops.mul_mat(v, const((v.shape[-1], p["n"]), p["seed"])),
        ),
        "mul_mat_left": (  # C @ v
            lambda v, p, x: const((p["n"], v.shape[-2]), p["seed"]) @ v,
            lambda v, p, x: ops.mul_mat(const((p["n"], v.shape[-2]), p["seed"]), v),
        ),
        "mul_mat_self": (  # v @ v^T: the same value on both sides
            lambda v, p, x: v @ np.swapaxes(v, -1, -2),
            lambda v, p, x: ops.mul_mat(v, ops.transpose(v)),
        ),
        "transpose": (lambda v, p, x: np.swapaxes(v, -1, -2), lambda v, p, x: ops.transpose(v)),
        "permute": (lambda v, p, x: np.transpose(v, p["axes"]), lambda v, p, x: ops.permute(v, p["axes"])),
        "cont": (lambda v, p, x: v, lambda v, p, x: ops.cont(v)),
        "reshape": (lambda v, p, x: v.reshape(p["shape"]), lambda v, p, x: ops.reshape(v, p["shape"])),
        "repeat": (lambda v, p, x: np.tile(v, p["reps"]), lambda v, p, x: ops.repeat(v, p["shape"])),
        "get_rows": (
            lambda v, p, x: v[np.array(p["idx"])],
            lambda v, p, x: ops.get_rows(v, np.array(p["idx"], np.int32)),
        ),
        "rope": (
            lambda v, p, x: rope_ref(v, np.arange(v.shape[0], dtype=np.float64) * 3 + 1, v.shape[-1], p["mode"]),
            lambda v, p, x: ops.rope(v, np.arange(v.shape[0], dtype=np.int32) * 3 + 1, v.shape[-1], p["mode"]),
        ),
        "f16_round_trip": (  # float32 -> float16 -> float32 (ggml_cpy both ways): d = 1 up to f16 rounding
            lambda v, p, x: v,
            lambda v, p, x: ops.cast(ops.cast(v, np.float16), np.float32),
        ),
        # ops ggml has no backward for: grad must raise TypeError naming them
        "clamp": (None, lambda v, p, x: ops.clamp(v, -0.5, 0.5)),
        "l2_norm": (None, lambda v, p, x: ops.l2_norm(v)),
        "concat": (None, lambda v, p, x: ops.concat(v, v, axis=-1)),
        "pad": (None, lambda v, p, x: ops.pad(v, [(0, 1)] * v.ndim)),
    }


def numpy_forward(program, x) -> np.ndarray:
    """The program's output in float64 (numpy)."""
    steps, x = _steps(), np.asarray(x, np.float64)
    v = x
    for name, p in program:
        v = steps[name][0](v, p, x)
    return v


def well_conditioned(program, x, floor=1e-2) -> bool:
    """False where a float32 evaluation cannot be compared with float64 at a fixed tolerance: a
    norm of a (nearly) constant row or an rms_norm of a (nearly) zero row amplifies float32
    rounding by up to 1/sqrt(eps); abs/relu of a value near 0 may take the other branch."""
    steps, x = _steps(), np.asarray(x, np.float64)
    v = x
    for name, p in program:
        if name == "norm" and v.var(-1).min() < floor:
            return False
        if name == "rms_norm" and (v * v).mean(-1).min() < floor:
            return False
        if name in ("abs", "relu") and np.abs(v).min() < floor * max(1.0, np.abs(v).max()):
            return False  # a value at the kink: float32 rounding may pick the other side
        v = steps[name][0](v, p, x)
    return True


def numpy_program(program, x, w) -> float:
    return float((numpy_forward(program, x) * w).sum())


def has_numpy(program) -> bool:
    steps = _steps()
    return all(steps[name][0] is not None for name, _ in program)


def ggml_grad(program, x, w, backend=None):
    from llamabind import ops

    steps = _steps()

    def f(xv):
        v = xv
        for name, p in program:
            v = steps[name][1](v, p, xv)
        return ops.sum(ops.mul(v, w))

    return ops.grad(f, backend=backend)(x)


def fd_grad(program, x, w, eps=1e-6):
    """Central finite differences of the float64 program."""
    g = np.zeros(x.shape)
    x64 = x.astype(np.float64)
    for idx in np.ndindex(x.shape):
        xp, xm = x64.copy(), x64.copy()
        xp[idx] += eps
        xm[idx] -= eps
        g[idx] = (numpy_program(program, xp, w) - numpy_program(program, xm, w)) / (2 * eps)
    return g


def worker() -> None:
    backend = os.environ.get("LLAMABIND_TEST_BACKEND") or None
    reply = os.fdopen(os.dup(1), "w")  # answers on the real stdout; what native code prints goes to stderr
    os.dup2(2, 1)
    for line in sys.stdin:
        req = json.loads(line)
        x = np.asarray(req["x"], np.float32)
        w = np.asarray(req["w"], np.float32)
        try:
            g = ggml_grad(req["program"], x, w, backend)
            out = {"grad": np.asarray(g, np.float64).tolist()}
        except Exception as e:  # reported to the test, which decides what is allowed
            out = {"error": type(e).__name__, "message": str(e)}
        reply.write(json.dumps(out) + "\n")
        reply.flush()


if __name__ == "__main__":
    worker()
