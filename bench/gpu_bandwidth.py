#!/usr/bin/env python3
"""The GPU's achievable memory bandwidth, measured: the denominator of tg128's bandwidth fraction.

    python bench/gpu_bandwidth.py [--gib 4] [--device 0] [--out FILE.json]

Two kernels on a buffer far larger than L2 (PyTorch, or CuPy when PyTorch is missing): a
device-to-device copy (bytes read + bytes written per second) and a full reduction (bytes read per
second, the access pattern of token generation, which streams every weight once per token). Each is
the median of 20 timed runs (CUDA events) after 3 warm-ups. Prints both and the larger, in GB/s
(10^9 bytes), and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def measure_torch(n_bytes: int, device: int, runs: int) -> dict:
    import torch

    dev = torch.device("cuda", device)
    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=dev)
    y = torch.empty_like(x)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(runs):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        return statistics.median(times)

    copy_s = timed(lambda: y.copy_(x))
    read_s = timed(lambda: x.sum())
    return {
        "impl": f"torch {torch.__version__}",
        "gpu": torch.cuda.get_device_name(dev),
        "copy_gbs": 2 * x.nbytes / copy_s / 1e9,
        "read_gbs": x.nbytes / read_s / 1e9,
    }


def measure_cupy(n_bytes: int, device: int, runs: int) -> dict:
    import cupy as cp
    from cupyx.profiler import benchmark

    with cp.cuda.Device(device):
        x = cp.ones(n_bytes // 4, dtype=cp.float32)
        y = cp.empty_like(x)
        copy_s = statistics.median(benchmark(lambda: y.__setitem__(..., x), n_repeat=runs, n_warmup=3).gpu_times[0])
        read_s = statistics.median(benchmark(lambda: x.sum(), n_repeat=runs, n_warmup=3).gpu_times[0])
        name = cp.cuda.runtime.getDeviceProperties(device)["name"].decode()
    return {
        "impl": f"cupy {cp.__version__}",
        "gpu": name,
        "copy_gbs": 2 * x.nbytes / copy_s / 1e9,
        "read_gbs": x.nbytes / read_s / 1e9,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0, help="buffer size in GiB")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n = int(args.gib * 2**30)
    try:
        res = measure_torch(n, args.device, args.runs)
    except ImportError:
        res = measure_cupy(n, args.device, args.runs)
    res["bandwidth_gbs"] = max(res["copy_gbs"], res["read_gbs"])
    res["buffer_gib"] = args.gib
    print(
        f"{res['gpu']} ({res['impl']}): copy {res['copy_gbs']:.0f} GB/s (read + write), "
        f"read {res['read_gbs']:.0f} GB/s; measured bandwidth {res['bandwidth_gbs']:.0f} GB/s"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
