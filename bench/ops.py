#!/usr/bin/env python3
"""Per-op latency and bandwidth of llamabind.ops beside numpy (and PyTorch where installed), the
per-call overhead of a tiny op beside ggml-python 0.0.45, and a 10-op chain on each device three
ways: numpy round trips per op, ops.DeviceArray (one copy in, one out), PyTorch on the same device
-- all in one run (rounds interleaved; the machine is noisy: read ratios).

    python bench/ops.py [--rounds 5] [--ggml-python bench/.venv-ggml-python/bin/python]

Prints a table and writes bench/results/ops-<host>-<date>.json. ggml-python runs in its own
virtual environment (it brings its own libggml) through bench/_ggml_python_worker.py; create it
with `python -m venv bench/.venv-ggml-python && bench/.venv-ggml-python/bin/pip install
ggml-python==0.0.45 numpy` (a source build, a few minutes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import llamabind
from llamabind import ops

HERE = Path(__file__).resolve().parent


def per_call_us(fn, min_time=0.2) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_time and n >= 10:
            return dt / n * 1e6


def cases(rng, dev: str, torch=None):
    def f32(*s):
        return rng.standard_normal(s).astype(np.float32)

    small, large = f32(64, 64), f32(2048, 2048)
    a, b = f32(1024, 1024), f32(1024, 1024)
    x = f32(512, 4096)
    tdev = torch_device(torch, dev)
    T = (lambda v: torch.from_numpy(v)) if tdev else (lambda v: None)  # host tensors: torch copies in, as we do
    ts, tl, ta, tb, tx = T(small), T(large), T(a), T(b), T(x)

    def tch(f):  # host in, host out on tdev (the llamabind column takes numpy arrays and returns them)
        if not tdev:
            return None
        if tdev == "cpu":
            return f
        return lambda: f().cpu()

    def U(t):  # the copy in that a host-in call makes on a GPU
        return t if tdev == "cpu" else t.to(tdev)

    def unary(v, tv, names):  # (name, llamabind, numpy, torch, bytes) rows of one-input ops on v
        fns = {
            "silu": (ops.silu, lambda: v / (1 + np.exp(-v)), lambda: torch.nn.functional.silu(U(tv))),
            "soft_max": (ops.soft_max, lambda: _softmax(v), lambda: U(tv).softmax(-1)),
            "rms_norm": (ops.rms_norm, lambda: _rms_numpy(v), lambda: _rms_torch(torch, U(tv))),
        }
        shape = "x".join(map(str, v.shape))
        return [
            (f"{n} {shape}", lambda op=fns[n][0]: op(v, backend=dev), fns[n][1], tch(fns[n][2]), 2 * v.nbytes)
            for n in names
        ]

    extra = []
    if dev != "CPU":  # per-call cost with the data already on the device: DeviceArray vs torch tensors
        ds = ops.to_device(small, dev)
        rs = torch.from_numpy(small).to(tdev) if tdev else None
        extra.append(
            (
                "add 64x64 on-device arrays",
                lambda: ops.add(ds, ds),
                lambda: np.add(small, small),
                (lambda: (rs + rs, torch.cuda.synchronize())) if tdev else None,  # ours returns finished work
                3 * small.nbytes,
            )
        )
    return extra + [
        # name, llamabind call, numpy call, torch call (or None), bytes moved (for GB/s)
        (
            "add 64x64 (per-call overhead)",
            lambda: ops.add(small, small, backend=dev),
            lambda: np.add(small, small),
            tch(lambda: U(ts) + U(ts)),
            3 * small.nbytes,
        ),
        (
            "add 2048x2048",
            lambda: ops.add(large, large, backend=dev),
            lambda: np.add(large, large),
            tch(lambda: U(tl) + U(tl)),
            3 * large.nbytes,
        ),
        *unary(large, tl, ("silu",)),
        *unary(x, tx, ("soft_max", "rms_norm")),
        (
            "mul_mat 1024^3",
            lambda: ops.mul_mat(a, b, backend=dev),
            lambda: a @ b,
            tch(lambda: U(ta) @ U(tb)),
            3 * a.nbytes,
        ),
        *unary(small, ts, ("silu", "soft_max", "rms_norm")),  # small shapes: the per-call cost of each op
        (
            "mul_mat 64^3",
            lambda: ops.mul_mat(small, small, backend=dev),
            lambda: small @ small,
            tch(lambda: U(ts) @ U(ts)),
            3 * small.nbytes,
        ),
    ]


def chain(x, b, dev: str):
    """10 ops; numpy arrays in: numpy round trips per op, DeviceArrays in: no copies."""
    y = ops.add(x, b, backend=dev)
    y = ops.mul(y, b, backend=dev)
    y = ops.silu(y, backend=dev)
    y = ops.scale(y, 0.5, backend=dev)
    y = ops.rms_norm(y, backend=dev)
    y = ops.add(y, x, backend=dev)
    y = ops.gelu(y, backend=dev)
    y = ops.sub(y, b, backend=dev)
    y = ops.soft_max(y, backend=dev)
    return ops.sqr(y, backend=dev)


def chain_torch(torch, x, b):
    F = torch.nn.functional
    y = F.silu((x + b) * b) * 0.5
    y = y * torch.rsqrt((y * y).mean(-1, keepdim=True) + 1e-5)
    y = F.gelu(y + x, approximate="tanh") - b
    return torch.square(torch.softmax(y, -1))


def chain_f64(x, b):
    """The chain in numpy float64 (the reference for NMSE)."""
    x, b = x.astype(np.float64), b.astype(np.float64)
    y = (x + b) * b
    y = y / (1 + np.exp(-y)) * 0.5
    y = y / np.sqrt((y * y).mean(-1, keepdims=True) + 1e-5) + x
    y = 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y**3))) - b
    return np.square(_softmax(y))


def chain_cases(rng, dev: str, torch=None):
    """(name, llamabind numpy round trips, llamabind DeviceArray, torch or None, reference fn) per size;
    each call starts from host arrays and ends with a host array."""
    tdev = torch_device(torch, dev)
    out = []
    for n in (512, 2048):
        x = rng.standard_normal((n, n)).astype(np.float32)
        b = rng.standard_normal((n, n)).astype(np.float32)

        def dev_arrays(x=x, b=b):
            return chain(ops.to_device(x, dev), ops.to_device(b, dev), dev).numpy()

        def torch_fn(x=x, b=b):
            r = chain_torch(torch, torch.from_numpy(x).to(tdev), torch.from_numpy(b).to(tdev))
            return r.cpu().numpy()

        out.append(
            (
                f"10-op chain {n}x{n}",
                (lambda x=x, b=b: chain(x, b, dev)),
                dev_arrays,
                torch_fn if tdev else None,
                (lambda x=x, b=b: chain_f64(x, b)),
            )
        )
    return out


def torch_device(torch, dev: str) -> str | None:
    """torch's device for a ggml device name: "cpu", "cuda:N", or None (no torch, or no such device)."""
    if torch is None:
        return None
    if dev == "CPU":
        return "cpu"
    if dev.startswith("CUDA") and torch.cuda.is_available():
        return f"cuda:{int(dev[4:])}"
    return None


def _rms_numpy(v):
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-5)


def _rms_torch(torch, t):
    return t * torch.rsqrt((t * t).mean(-1, keepdim=True) + 1e-5)


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def ggml_python_round(python: str | None) -> dict | None:
    if not python or not Path(python).exists():
        return None
    p = subprocess.run([python, str(HERE / "_ggml_python_worker.py")], capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        print(f"ggml-python worker failed: {p.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return json.loads(p.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ggml-python", default=str(HERE / ".venv-ggml-python" / "bin" / "python"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    try:
        import torch

        torch.set_num_threads(max(1, len(__import__("os").sched_getaffinity(0))))
    except ImportError:
        torch = None
    devices = [d["name"] for d in ops.devices()]
    per_dev = {dev: cases(rng, dev, torch) for dev in devices}
    res = {
        (dev, name): {"llamabind_us": [], "numpy_us": [], "torch_us": [], "bytes": nbytes}
        for dev, cs in per_dev.items()
        for name, _, _, _, nbytes in cs
    }
    per_chain = {dev: chain_cases(rng, dev, torch) for dev in devices}
    chains = {
        (dev, name): {"numpy_round_trips_us": [], "device_array_us": [], "torch_us": []}
        for dev, cs in per_chain.items()
        for name, *_ in cs
    }
    ggp = {"per_call_us": [], "reused_graph_us": []}
    for r in range(args.rounds):  # interleaved: llamabind (each device), numpy, torch, ggml-python each round
        for dev, cs in per_dev.items():
            for name, lb, npf, tf, _ in cs:
                res[(dev, name)]["llamabind_us"].append(per_call_us(lb))
                res[(dev, name)]["numpy_us"].append(per_call_us(npf))
                if tf is not None:
                    res[(dev, name)]["torch_us"].append(per_call_us(tf))
        for dev, cs in per_chain.items():
            for name, rt, da, tf, _ in cs:
                d = chains[(dev, name)]
                d["numpy_round_trips_us"].append(per_call_us(rt))
                d["device_array_us"].append(per_call_us(da))
                if tf is not None:
                    d["torch_us"].append(per_call_us(tf))
        g = ggml_python_round(args.ggml_python)
        if g:
            ggp["per_call_us"].append(g["per_call_us"])
            ggp["reused_graph_us"].append(g["reused_graph_us"])
    rows = []
    print(f"{'device':8} {'op':32} {'llamabind us':>13} {'numpy us':>10} {'torch us':>9} {'lb/np':>6} {'GB/s':>7}")
    for (dev, name), d in res.items():
        lb, npm = statistics.median(d["llamabind_us"]), statistics.median(d["numpy_us"])
        tq = statistics.median(d["torch_us"]) if d["torch_us"] else None
        gbs = d["bytes"] / (lb * 1e-6) / 1e9
        rows.append(
            {
                "device": dev,
                "op": name,
                "llamabind_us": lb,
                "numpy_us": npm,
                "torch_us": tq,
                "ratio_numpy": lb / npm,
                "llamabind_GBps": gbs,
            }
        )
        tstr = f"{tq:9.1f}" if tq is not None else f"{'-':>9}"
        print(f"{dev:8} {name:32} {lb:13.1f} {npm:10.1f} {tstr} {lb / npm:6.2f} {gbs:7.2f}")
    overhead = next(r["llamabind_us"] for r in rows if r["device"] == "CPU")
    print(f"\nper-call overhead, 64x64 float32 add on CPU: llamabind {overhead:.2f} us (target <= 3 us)")
    chain_rows = []
    print(
        f"\n{'device':8} {'chain (host in, host out)':26} {'round trips us':>15} {'DeviceArray us':>15} "
        f"{'torch us':>10} {'DA/torch':>9} {'NMSE vs f64':>12}"
    )
    for (dev, name), d in chains.items():
        rt, da = statistics.median(d["numpy_round_trips_us"]), statistics.median(d["device_array_us"])
        tq = statistics.median(d["torch_us"]) if d["torch_us"] else None
        case = next(c for c in per_chain[dev] if c[0] == name)
        err = float(ops.nmse(case[2](), case[4]()))
        chain_rows.append(
            {
                "device": dev,
                "chain": name,
                "numpy_round_trips_us": rt,
                "device_array_us": da,
                "torch_us": tq,
                "ratio_torch": da / tq if tq else None,
                "nmse_vs_float64": err,
            }
        )
        tstr = f"{tq:10.0f} {da / tq:9.2f}" if tq else f"{'-':>10} {'-':>9}"
        print(f"{dev:8} {name:26} {rt:15.0f} {da:15.0f} {tstr} {err:12.2e}")
    if ggp["per_call_us"]:
        pc, rg = statistics.median(ggp["per_call_us"]), statistics.median(ggp["reused_graph_us"])
        print(
            f"ggml-python 0.0.45: {pc:.1f} us building the graph per call, {rg:.1f} us reusing one graph "
            f"(llamabind / ggml-python reused: {overhead / rg:.2f})"
        )
    else:
        print("ggml-python 0.0.45: not measured (no venv at --ggml-python)")
    out = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "rounds": args.rounds,
        "build_info": {k: v for k, v in llamabind.build_info().items() if k != "devices"},
        "ops": rows,
        "chains": chain_rows,
        "raw": {f"{d}|{n}": v for (d, n), v in res.items()},
        "raw_chains": {f"{d}|{n}": v for (d, n), v in chains.items()},
        "ggml_python_0_0_45": {k: statistics.median(v) for k, v in ggp.items()} if ggp["per_call_us"] else None,
    }
    path = Path(args.out) if args.out else HERE / "results" / f"ops-{socket.gethostname()}-{datetime.date.today()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
