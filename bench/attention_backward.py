"""Flash attention's backward alone, llamabind (ggml's FLASH_ATTN_BACK, patches 0050, 0051 and 0065) beside PyTorch's
scaled_dot_product_attention (bf16, its flash backward) at one training shape: the kernel-level ratio behind
bench/train.py's long-context rows (issue 56).

    python bench/attention_backward.py [--batch 4 --heads 32 --kv-heads 8 --ctx 2048 --head-dim 64] [--out F.json]

llamabind: ``ops.grad`` of ``sum(flash_attn_ext(q, k, v, causal mask) * w)`` on the GPU; its time per call includes
the forward, the transfers and the graph's set-up, so the kernels' own time is read with Nsight Compute (run the
script under ``ncu -k regex:fa_back``, as tests/device/cuda_run.sh fa56ncu does). PyTorch: the backward of SDPA
under bf16 (is_causal, enable_gqa), CUDA events, median of ``--reps``. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def torch_times(b: int, h: int, hk: int, n: int, d: int, reps: int) -> dict:
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    q = torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hk, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hk, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16)
    fwd, bwd = [], []
    for i in range(reps + 3):
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hk != h)
        e1.record()
        out.backward(dout)
        e2.record()
        torch.cuda.synchronize()
        if i >= 3:
            fwd.append(e0.elapsed_time(e1))
            bwd.append(e1.elapsed_time(e2))
        q.grad = k.grad = v.grad = None
    return {"forward_ms": statistics.median(fwd), "backward_ms": statistics.median(bwd)}


def llamabind_times(b: int, h: int, hk: int, n: int, d: int, reps: int, backend: str) -> dict:
    from llamabind import ops

    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, h, n, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, hk, n, d)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal((b, h, n, d)).astype(np.float32)
    mask = np.triu(np.full((n, n), -np.inf, np.float32), 1).astype(np.float16)

    def loss(q, k, v):
        return ops.sum(
            ops.mul(ops.flash_attn_ext(q, ops.cast(k, np.float16), ops.cast(v, np.float16), mask, scale=d**-0.5), w)
        )

    g = ops.grad(loss, argnums=(0, 1, 2), backend=backend)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        g(q, k, v)
        if i:
            times.append((time.perf_counter() - t0) * 1e3)
    return {"grad_call_ms": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--runners", default="llamabind,torch", help="llamabind, torch or both")
    ap.add_argument("--out", default=None, help="JSON file")
    a = ap.parse_args()
    shape = (a.batch, a.heads, a.kv_heads, a.ctx, a.head_dim)
    flops = 4 * a.batch * a.heads * a.ctx * a.ctx * a.head_dim / 2  # causal: half the forward's two products
    res: dict = {"shape": dict(zip(("batch", "heads", "kv_heads", "ctx", "head_dim"), shape)), "forward_flop": flops}
    if "torch" in a.runners:
        res["torch_bf16"] = torch_times(*shape, a.reps)
    if "llamabind" in a.runners:
        res["llamabind"] = llamabind_times(*shape, a.reps, a.backend)
    print("| runner | batch x heads (kv) x ctx x head_dim | forward ms | backward ms | backward TFLOP/s (2.5x fwd) |")
    print("|---|---|---|---|---|")
    dims = f"{a.batch} x {a.heads} ({a.kv_heads}) x {a.ctx} x {a.head_dim}"
    if "torch_bf16" in res:
        t = res["torch_bf16"]
        print(
            f"| PyTorch SDPA bf16 | {dims} | {t['forward_ms']:.3f} | {t['backward_ms']:.3f} | "
            f"{2.5 * flops / t['backward_ms'] / 1e9:.1f} |"
        )
    if "llamabind" in res:
        print(
            f"| llamabind ops.grad (forward + backward + transfers; kernels: ncu) | {dims} | | "
            f"{res['llamabind']['grad_call_ms']:.3f} | |"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
