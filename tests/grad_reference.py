"""PyTorch float64 autograd for the named compositions of tests/test_grad_compositions.py.

Runs in the side venv (tests/embed/requirements.txt): ``python grad_reference.py IN.npz OUT.npz``.
IN holds, for each composition NAME, arrays ``NAME/arg`` (the inputs, float32) and
``NAME/loss_w`` (the loss weights); OUT gets ``NAME/loss`` and ``NAME/d_arg`` for every argument.
The functions here are written from the ops' definitions, independently of ggml.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch
import torch.nn.functional as F


def rope(x, pos, base=10000.0):
    """Rotate adjacent pairs (ggml's "normal" mode); x (T, H, d), pos (T,)."""
    d = x.shape[-1]
    theta = pos[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    c, s = torch.cos(theta)[:, None, :], torch.sin(theta)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)


def rms_norm(x, eps=1e-5):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def attention(x, wq, wk, wv, n_head):
    t, d = x.shape
    hd = d // n_head
    h = rms_norm(x)
    pos = torch.arange(t, dtype=x.dtype)
    q = rope((h @ wq).reshape(t, n_head, hd), pos).permute(1, 0, 2)
    k = rope((h @ wk).reshape(t, n_head, hd), pos).permute(1, 0, 2)
    v = (h @ wv).reshape(t, n_head, hd).permute(1, 0, 2)
    mask = torch.triu(torch.full((t, t), -math.inf, dtype=x.dtype), 1)
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, -1)
    return (p @ v).permute(1, 0, 2).reshape(t, d)


FUNCS = {
    "attention": lambda a: attention(a["x"], a["wq"], a["wk"], a["wv"], 2),
    "swiglu_mlp": lambda a: (F.silu(a["x"] @ a["w1"]) * (a["x"] @ a["w3"])) @ a["w2"],
    "rms_norm_rope": lambda a: rope(rms_norm(a["x"]) * a["g"], torch.arange(a["x"].shape[0], dtype=a["x"].dtype)),
    "layer_norm_gelu": lambda a: (
        F.gelu(F.layer_norm(a["x"], a["x"].shape[-1:], eps=1e-5) * a["g"] + a["b"], approximate="tanh") @ a["w"]
    ),
    "cross_entropy": lambda a: F.cross_entropy(a["h"] @ a["wout"], a["labels"].long(), reduction="mean")[None],
    # PyTorch's own attention (its float64 math backend on the CPU), causal, grouped-query heads
    "flash_attention": lambda a: F.scaled_dot_product_attention(
        a["q"], a["k"], a["v"], is_causal=True, scale=1 / math.sqrt(a["q"].shape[-1]), enable_gqa=True
    ),
}


def main(src: str, dst: str) -> None:
    data = np.load(src)
    out: dict[str, np.ndarray] = {}
    for name, fn in FUNCS.items():
        keys = [k.split("/", 1)[1] for k in data.files if k.startswith(name + "/") and k != name + "/loss_w"]
        if not keys:
            continue
        args = {
            k: torch.tensor(
                data[f"{name}/{k}"].astype(np.float64 if k != "labels" else np.int64), requires_grad=k != "labels"
            )
            for k in keys
        }
        y = fn(args)
        loss = (y * torch.tensor(data[f"{name}/loss_w"].astype(np.float64))).sum()
        loss.backward()
        out[f"{name}/loss"] = np.array(loss.item())
        for k, t in args.items():
            if t.grad is not None:
                out[f"{name}/d_{k}"] = t.grad.numpy()
    np.savez(dst, **out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
