"""The flash-attention training kernels (fattn-back.cu of the patched tree) checked and timed outside llamabind.

Builds tests/device/fa_harness.cu with nvcc against a patched ggml tree (--ggml, default vendor/llama.cpp/ggml),
then on the GPU, with PyTorch:
  - each dK/dV kernel variant (fa_harness.cu's fah_dkdv: 0 = 64 keys a block, 1 = 128 keys a block / 32 a warp,
    2 = no dQ, run with one block a K/V head; --backward's fah_dkdv_d: 0 = the mma.sync kernel, 3 = the wgmma one,
    4 = the wgmma one with dQ by bulk reductions) and the training forward against a float64 reference of
    attention's forward and backward (autograd), by NMSE, on shapes that reach the kernels' edges (ragged
    blocks, GQA, no mask, block-diagonal and random masks with mixed tiles);
  - the variants' times at the 1B shape (4 x 32 heads, 8 K/V, 2048 x 64, causal) beside PyTorch's SDPA in bf16
    (its own choice of backend, and its flash kernels; forward, and forward + backward), CUDA events, median
    of --reps.
Prints a table and writes fa-harness.json to $OUT (or --out). Run on the device machine from the repository root:
    python3 tests/device/fa_harness.py --ggml DIR
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

D = 64
NMSE_LIMIT = 1e-4  # BF16 operands (Q, K, V, dO, P, dS) with F32 accumulation against float64, as the CUDA op tests


def build(ggml: str, out: str) -> ctypes.CDLL:
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fa_harness.cu")
    cmd = [
        "nvcc",
        "-O3",
        "-std=c++17",
        "-arch=sm_90a",  # (wgmma: the architecture-specific features)
        "-shared",
        "-Xcompiler",
        "-fPIC",
        f"-I{ggml}/include",
        f"-I{ggml}/src",
        f"-I{ggml}/src/ggml-cuda",
        src,
        "-o",
        out,
    ]
    t0 = time.time()
    subprocess.run(cmd, check=True)
    print(f"built {out} in {time.time() - t0:.0f} s", flush=True)
    lib = ctypes.CDLL(out)
    P, N, L, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float  # pointer, int, int64, float
    lib.fah_tiles.argtypes = [P, P, N, N, L, L, L, N, N]
    lib.fah_fwd.argtypes = [N, N, P, P, P, P, L, L, L, N, N, P, P, P, N, N, N, N, N, N, F]
    lib.fah_dkdv.argtypes = [N, P, P, P, P, P, L, L, L, N, N, P, P, P, P, P, P, N, N, N, N, N, N, F, N, N]
    lib.fah_dkdv_d.argtypes = [N, N, P, P, P, P, P, L, L, L, N, N, P, P, P, P, P, P, N, N, N, N, N, N, F, N, N]
    return lib


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: cudaError {rc}")


def make_mask(kind: str, N: int, M: int, gen: torch.Generator) -> torch.Tensor | None:
    """An F16 [N, M] mask (0 / -inf, or finite values) of one slice, or None."""
    if kind == "none":
        return None
    i = torch.arange(N, device="cuda")[:, None]
    j = torch.arange(M, device="cuda")[None, :]
    if kind == "causal":
        allowed = j <= i + (M - N)
    elif kind == "blocks":  # three sequences of unequal lengths, causal within each (a batch packed in one window)
        cuts = [0, int(N * 0.39), int(N * 0.68), N]
        seq = torch.bucketize(torch.arange(N, device="cuda"), torch.tensor(cuts[1:-1], device="cuda"), right=True)
        allowed = (seq[:, None] == seq[None, :]) & (j <= i)
    elif kind == "random":  # finite values and -inf everywhere: every tile mixed; each row keeps its first key
        vals = torch.randn(N, M, device="cuda", generator=gen)
        m = torch.where(torch.rand(N, M, device="cuda", generator=gen) < 0.3, float("-inf"), vals)
        m[:, 0] = 0.0
        return m.half().contiguous()
    else:
        raise ValueError(kind)
    return torch.where(allowed, 0.0, float("-inf")).half().contiguous()


class Case:
    """Inputs in the kernels' layouts: Q, dO [S, H, N, D], K, V [Sk, Hk, M, D] BF16; the mask and its tile classes;
    the training forward's O and log-sum-exp; D_i = rowsum(dO * O)."""

    def __init__(self, lib, S, H, Hk, N, M, mask_kind, seed=0, d=D, backward=True):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.lib, self.S, self.H, self.Hk, self.N, self.M, self.d = lib, S, H, Hk, N, M, d
        D = d  # noqa: N806 (the head size of this case)
        self.scale = 1.0 / math.sqrt(D)
        self.q = torch.randn(S, H, N, D, device="cuda", generator=g).bfloat16()
        self.k = torch.randn(S, Hk, M, D, device="cuda", generator=g).bfloat16()
        self.v = torch.randn(S, Hk, M, D, device="cuda", generator=g).bfloat16()
        self.do = torch.randn(S, H, N, D, device="cuda", generator=g).bfloat16()
        self.mask = make_mask(mask_kind, N, M, g)
        nqb, nkb = (N + 63) // 64, (M + 63) // 64
        self.tiles = torch.zeros(nqb * nkb, dtype=torch.uint8, device="cuda")
        if self.mask is not None:
            check(
                lib.fah_tiles(self.mask.data_ptr(), self.tiles.data_ptr(), N, M, M * 2, N * M * 2, N * M * 2, 1, 1),
                "fah_tiles",
            )
        self.out = torch.full((S, N, H, D), float("nan"), device="cuda")
        self.lse = torch.full((S, H, N), float("nan"), device="cuda")
        if backward:
            self.forward()
            self.o = self.out.permute(0, 2, 1, 3).contiguous()
            self.dsum = (self.do.float() * self.o).sum(-1).contiguous()

    def _mask_args(self):
        m = self.mask
        ptr = m.data_ptr() if m is not None else None
        return [ptr, self.M * 2, self.N * self.M * 2, self.N * self.M * 2, 1, 1, self.tiles.data_ptr()]

    def _shape_args(self):
        """N, M, H, Hk, S, Sk (= S) and the scale, as the kernels take them."""
        return [self.N, self.M, self.H, self.Hk, self.S, self.S, self.scale]

    def forward(self, variant: int = 0):  # (fa_harness.cu's fah_fwd: 0, fa_fwd_mma; 1, fa_fwd_wgmma)
        check(
            self.lib.fah_fwd(
                variant,
                self.d,
                self.q.data_ptr(),
                self.k.data_ptr(),
                self.v.data_ptr(),
                *self._mask_args(),
                self.out.data_ptr(),
                self.lse.data_ptr(),
                *self._shape_args(),
            ),
            f"fah_fwd({variant})",
        )

    def backward(self, variant: int):
        S, H, Hk, N, M = self.S, self.H, self.Hk, self.N, self.M
        dq = torch.full((S, H, N, D), float("nan"), device="cuda")
        dk = torch.full((S, Hk, M, D), float("nan"), device="cuda")
        dv = torch.full((S, Hk, M, D), float("nan"), device="cuda")
        self.run_backward(variant, dq, dk, dv)
        return dq, dk, dv

    def run_backward(self, variant, dq, dk, dv, chunk=0):
        check(
            self.lib.fah_dkdv(
                variant,
                self.q.data_ptr(),
                self.k.data_ptr(),
                self.v.data_ptr(),
                self.do.data_ptr(),
                *self._mask_args(),
                dq.data_ptr(),
                dk.data_ptr(),
                dv.data_ptr(),
                self.lse.data_ptr(),
                self.dsum.data_ptr(),
                *self._shape_args(),
                self.H // self.Hk if variant != 2 else 1,
                chunk,
            ),
            f"fah_dkdv({variant}, chunk {chunk})",
        )

    def backward_d(self, variant: int, bufs=None, chunk: int = 0):
        """dq, dk, dv by fah_dkdv_d (0: fa_back_mma_dkdv<D, true, true>, 3: fa_back_wgmma_dkdv<D>) at this case's D, a
        block per query head (hparts = H / Hk, as ggml-cuda runs it); chunk > 0: the blocks dispatched in chunks of
        that many key blocks (GGML_CUDA_FA_BACK_KB_CHUNK), else the heads fastest."""
        S, H, Hk, N, M, d = self.S, self.H, self.Hk, self.N, self.M, self.d
        if bufs is None:
            bufs = [torch.full((S, x, n, d), float("nan"), device="cuda") for x, n in ((H, N), (Hk, M), (Hk, M))]
        dq, dk, dv = bufs
        args = [self.q, self.k, self.v, self.do]
        check(
            self.lib.fah_dkdv_d(
                variant,
                d,
                *(x.data_ptr() for x in args),
                *self._mask_args(),
                dq.data_ptr(),
                dk.data_ptr(),
                dv.data_ptr(),
                self.lse.data_ptr(),
                self.dsum.data_ptr(),
                *self._shape_args(),
                H // Hk,
                chunk,
            ),
            f"fah_dkdv_d({variant}, {d}, chunk {chunk})",
        )
        return dq, dk, dv

    def reference(self):
        """O, dQ, dK, dV of softmax(Q K^T * scale + mask) V in float64 from the BF16 inputs (autograd)."""
        r = self.H // self.Hk
        q = self.q.double().requires_grad_()
        k = self.k.double().requires_grad_()
        v = self.v.double().requires_grad_()
        kr, vr = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        s = q @ kr.transpose(-1, -2) * self.scale
        if self.mask is not None:
            s = s + self.mask.double()
        o = torch.softmax(s, dim=-1) @ vr
        self.lse_ref = torch.logsumexp(s.detach(), dim=-1) / math.log(2.0)  # log2 units, as the kernels' lse
        o.backward(self.do.double())
        return o.detach(), q.grad, k.grad, v.grad


def nmse(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return float(((x - ref) ** 2).sum() / (ref**2).sum())


def time_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


CHECKS = [  # S, H, Hk, N, M, mask
    (1, 2, 1, 2200, 2200, "causal"),  # ragged last blocks (64 and 128 keys), runs of masked tiles
    (2, 4, 2, 300, 300, "none"),  # no mask: open tiles, keys past n_kv in the last block
    (1, 4, 4, 1024, 1024, "blocks"),  # three packed sequences: masked, open and mixed tiles mid-matrix
    (2, 8, 2, 256, 384, "random"),  # finite mask values, every tile mixed, more keys than queries
    (1, 4, 1, 130, 1100, "causal"),  # few query rows, many keys (M > N: the causal diagonal shifted)
]


def record_check(report: dict, d: int, name: str, variant: int | str, errors: dict) -> int:
    """One row of a --forward / --backward check (each NMSE against float64 under NMSE_LIMIT) into report and the
    table; 1 if it failed."""
    bad = [k for k, x in errors.items() if not x < NMSE_LIMIT]
    report["checks"].append({"D": d, "case": name, "variant": variant, **errors, "failed": bad})
    cells = " | ".join(f"{x:.2e}" for x in errors.values())
    print(f"| {d} | {name} | {variant} | {cells} |" + (f" FAILED {bad}" if bad else ""), flush=True)
    return int(bool(bad))


def finish(report: dict, failed: int, path: str) -> int:
    """The report as JSON at path; the exit status (1 if a check failed)."""
    report["failed"] = failed
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{failed} checks failed")
    return 1 if failed else 0


def forward_main(lib, a) -> int:
    """--forward: the training forward's variants (fah_fwd) at D = 64 and 128 against float64 (O and the
    log-sum-exp), then timed beside SDPA's flash forward at the 1B (32 (8) x 64), 8B (32 (8) x 128) and 70B (64 (8)
    x 128) heads, batch 1, causal, 8k-32k tokens: ms and TFLOP/s of the causal FLOPs (4 N^2 D H / 2)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    variants = [int(v) for v in a.variants.split(",")]
    report = {"device": torch.cuda.get_device_name(), "checks": [], "timing": []}
    failed = 0
    print("| D | case | variant | O | lse |")
    print("|---|---|---|---|---|")
    for d in (64, 128):
        for S, H, Hk, N, M, kind in CHECKS:
            c = Case(lib, S, H, Hk, N, M, kind, seed=N + M, d=d, backward=False)
            o = c.reference()[0]
            for var in variants:
                c.out.fill_(float("nan"))
                c.lse.fill_(float("nan"))
                c.forward(var)
                errors = {"O": nmse(c.out.permute(0, 2, 1, 3), o), "lse": nmse(c.lse, c.lse_ref)}
                failed += record_check(report, d, f"{S}x{H}({Hk})x{N}x{M} {kind}", var, errors)
            del c
            torch.cuda.empty_cache()
    cols = " | ".join(f"v{v} ms" for v in variants)
    tcols = " / ".join(f"v{v}" for v in variants)
    print(f"\n| heads (kv) x D | ctx | SDPA flash ms | {cols} | TFLOP/s SDPA / {tcols} |")
    for H, Hk, d in ((32, 8, 64), (32, 8, 128), (64, 8, 128)):
        for N in [int(x) for x in a.ctx.split(",")]:
            c = Case(lib, 1, H, Hk, N, N, "causal", seed=1, d=d, backward=False)
            row = {"H": H, "Hk": Hk, "D": d, "ctx": N}
            q, k, v = c.q, c.k, c.v
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                row["sdpa_flash_ms"] = time_ms(
                    lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=True, enable_gqa=True
                    ),
                    a.reps,
                )
            outs = {}
            for var in variants:
                row[f"v{var}_ms"] = time_ms(lambda c=c, var=var: c.forward(var), a.reps)
                outs[var] = c.out.clone()
            row["nmse_vs_v0"] = {x: nmse(outs[x], outs[variants[0]]) for x in variants[1:]}
            flops = 4 * N * N * d * H / 2
            tf = [flops / row[k] / 1e9 for k in ["sdpa_flash_ms"] + [f"v{v}_ms" for v in variants]]
            row["tflops"] = tf
            report["timing"].append(row)
            print(
                f"| {H} ({Hk}) x {d} | {N} | {row['sdpa_flash_ms']:.3f} | "
                + " | ".join(f"{row[f'v{v}_ms']:.3f}" for v in variants)
                + " | "
                + " / ".join(f"{x:.0f}" for x in tf)
                + f" | nmse {row['nmse_vs_v0']}",
                flush=True,
            )
            c = q = k = v = outs = None
            torch.cuda.empty_cache()
    return finish(report, failed, os.path.join(a.out, "fa-forward.json"))


def backward_main(lib, a) -> int:
    """--backward: the dK/dV kernels with dQ (fah_dkdv_d: 0 mma.sync, 3 wgmma) at D = 64 and 128, their blocks
    dispatched the heads fastest (chunk 0) and in chunks of 3 and of all key blocks (GGML_CUDA_FA_BACK_KB_CHUNK),
    against float64 (dQ, dK, dV); then timed beside SDPA's flash backward (its forward + backward less its forward)
    at the 1B, 8B and 70B heads, --batch sequences, causal, in each order of --chunks ("max": every key block of a
    head before the next; "auto": max(8, key blocks / 8)); at D = 64 also patch 0088's kernel (fah_dkdv 1,
    ggml-cuda's default there)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    report = {"device": torch.cuda.get_device_name(), "checks": [], "timing": []}
    failed = 0
    print("| D | case | variant, chunk | dQ | dK | dV |")
    print("|---|---|---|---|---|---|")
    for d in (64, 128):
        for S, H, Hk, N, M, kind in CHECKS:
            c = Case(lib, S, H, Hk, N, M, kind, seed=N + M, d=d)
            _, dq_r, dk_r, dv_r = c.reference()
            for var in (0, 3):
                for chunk in (0, 3, 1 << 20):
                    got = c.backward_d(var, chunk=chunk)
                    errors = dict(zip(("dQ", "dK", "dV"), (nmse(x, r) for x, r in zip(got, (dq_r, dk_r, dv_r)))))
                    failed += record_check(report, d, f"{S}x{H}({Hk})x{N}x{M} {kind}", f"{var}, {chunk}", errors)
            c = None
            torch.cuda.empty_cache()
    chunks = [{"max": 1 << 20, "auto": -1}.get(x) or int(x) for x in a.chunks.split(",")]
    label = {1 << 20: "max", -1: "auto"}
    runs = [(v, ch) for v in (0, 3) for ch in chunks]  # (variant, chunk)
    names = [f"{'mma' if v == 0 else 'wgmma'}/{label.get(ch, ch)}" for v, ch in runs]
    print(f"\n{a.batch} sequence(s); ms of each (kernel / chunk), then TFLOP/s of SDPA and of each")
    print("| heads (kv) x D | ctx | SDPA flash bwd | " + " | ".join(names) + " | TFLOP/s |")
    for H, Hk, d in ((32, 8, 64), (32, 8, 128), (64, 8, 128)):
        for N in [int(x) for x in a.ctx.split(",")]:
            c = Case(lib, a.batch, H, Hk, N, N, "causal", seed=1, d=d)
            row = {"H": H, "Hk": Hk, "D": d, "ctx": N, "batch": a.batch}
            q, k, v, do = (x.detach().requires_grad_() for x in (c.q, c.k, c.v, c.do))

            def fwd(q=q, k=k, v=v):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                f = time_ms(fwd, a.reps)
                fb = time_ms(lambda fwd=fwd, do=do: fwd().backward(do), a.reps)
            row["sdpa_flash_bwd_ms"] = fb - f
            bufs = [torch.empty(a.batch, x, N, d, device="cuda") for x in (H, Hk, Hk)]
            base = None
            for (var, ch), name in zip(runs, names):
                fn = lambda c=c, var=var, bufs=bufs, ch=ch: c.backward_d(var, bufs, ch)  # noqa: E731
                row[f"{name}_ms"] = time_ms(fn, a.reps)
                got = [x.clone() for x in fn()]
                base = base or got
                row[f"{name}_nmse_vs_first"] = [nmse(x, y) for x, y in zip(got, base)]
            extra = ""
            if d == 64:  # patch 0088's 128-key kernel, ggml-cuda's default at D = 64
                dq, dk, dv = (torch.empty(a.batch, x, N, 64, device="cuda") for x in (H, Hk, Hk))
                for ch in chunks:
                    fn = lambda c=c, b=(dq, dk, dv), ch=ch: c.run_backward(1, *b, chunk=ch)  # noqa: E731
                    row[f"0088/{ch}_ms"] = time_ms(fn, a.reps)
                extra = " | 0088: " + ", ".join(f"{ch}: {row[f'0088/{ch}_ms']:.3f}" for ch in chunks)
            flops = 2.5 * 4 * N * N * d * H / 2 * a.batch
            tf = [flops / row[k] / 1e9 for k in ["sdpa_flash_bwd_ms"] + [f"{n}_ms" for n in names]]
            row["tflops"] = tf
            report["timing"].append(row)
            worst = max(max(row[f"{n}_nmse_vs_first"]) for n in names)
            print(
                f"| {H} ({Hk}) x {d} | {N} | {row['sdpa_flash_bwd_ms']:.3f} | "
                + " | ".join(f"{row[f'{n}_ms']:.3f}" for n in names)
                + " | "
                + " / ".join(f"{x:.0f}" for x in tf)
                + f" |{extra} nmse vs the first <= {worst:.1e}",
                flush=True,
            )
            c = q = k = v = do = bufs = base = None
            torch.cuda.empty_cache()
    return finish(report, failed, os.path.join(a.out, "fa-backward.json"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backward", action="store_true", help="the dK/dV kernels at D = 64 and 128 (backward_main)")
    ap.add_argument("--forward", action="store_true", help="the training forward's variants only (forward_main)")
    ap.add_argument("--ctx", default="8192,16384,32768", help="--forward: the timed lengths")
    ap.add_argument("--ggml", default="vendor/llama.cpp/ggml")
    ap.add_argument("--so", default="/tmp/fa_harness.so")
    ap.add_argument("--variants", default="0,1,2", help="fah_dkdv's variants (fa_harness.cu)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=1, help="--backward: sequences in the timed cases")
    ap.add_argument(
        "--chunks", default="0,16,auto,max", help="--backward: the dispatch orders timed (0: the heads fastest)"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    lib = build(a.ggml, a.so)
    if a.forward:
        return forward_main(lib, a)
    if a.backward:
        return backward_main(lib, a)
    variants = [int(v) for v in a.variants.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    report = {"device": torch.cuda.get_device_name(), "checks": [], "timing": {}}
    failed = 0
    print("| case | variant | O | dQ | dK | dV |")
    print("|---|---|---|---|---|---|")
    for S, H, Hk, N, M, kind in CHECKS:
        c = Case(lib, S, H, Hk, N, M, kind, seed=N + M)
        o, dq_r, dk_r, dv_r = c.reference()
        name = f"{S}x{H}({Hk})x{N}x{M} {kind}"
        e_o = nmse(c.o, o)
        for var in variants:
            dq, dk, dv = c.backward(var)
            e = {"O": e_o, "dV": nmse(dv, dv_r), "dK": nmse(dk, dk_r), "dQ": nmse(dq, dq_r) if var != 2 else None}
            bad = [k for k, x in e.items() if x is not None and not x < NMSE_LIMIT]
            failed += bool(bad)
            report["checks"].append({"case": name, "variant": var, **e, "failed": bad})
            fmt = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
            print(
                f"| {name} | {var} | {fmt(e['O'])} | {fmt(e['dQ'])} | {fmt(e['dK'])} | {fmt(e['dV'])} |"
                + (f" FAILED {bad}" if bad else ""),
                flush=True,
            )
        del c
        torch.cuda.empty_cache()

    # the 1B shape: times, and each variant against variant 0 (whose float64 check above covers its arithmetic)
    S, H, Hk, N = 4, 32, 8, 2048
    c = Case(lib, S, H, Hk, N, N, "causal", seed=1)
    t = report["timing"]
    t["train_forward_ms"] = time_ms(c.forward, a.reps)
    base = c.backward(0)
    bufs = [torch.empty_like(x) for x in base]
    for var in variants:
        t[f"dkdv_{var}_ms"] = time_ms(lambda: c.run_backward(var, *bufs), a.reps)
        got = c.backward(var)
        t[f"dkdv_{var}_nmse_vs_0"] = [nmse(x, y) for x, y in zip(got, base)] if var != 2 else None
    q, k, v, do = (x.detach().requires_grad_() for x in (c.q, c.k, c.v, c.do))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fwd():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def fwd_bwd():
        fwd().backward(do)

    # PyTorch's own choice of backend (what transformers' sdpa attention gets), then its flash kernels
    for label, ctx in (("sdpa", None), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(ctx) if ctx is not None else contextlib.nullcontext():
            t[f"{label}_forward_ms"] = time_ms(fwd, a.reps)
            t[f"{label}_forward_backward_ms"] = time_ms(fwd_bwd, a.reps)
        t[f"{label}_backward_ms"] = t[f"{label}_forward_backward_ms"] - t[f"{label}_forward_ms"]
    print(f"\n4 x 32 heads (8 K/V) x 2048 x 64, causal, {torch.cuda.get_device_name()}: median of {a.reps}")
    for key, val in t.items():
        print(f"  {key}: {val if isinstance(val, list) or val is None else round(val, 4)}")
    report["failed"] = failed
    with open(os.path.join(a.out, "fa-harness.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"{failed} checks failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
