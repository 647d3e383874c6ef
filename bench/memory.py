#!/usr/bin/env python3
"""Memory: peak RSS of load + generate through llamabind beside llama-bench (same model, same
n_ctx), and RSS drift of one process over many generate calls.

    python bench/memory.py [--model NAME|PATH] [--calls 500]

Peak RSS comes from each child process's ru_maxrss (Linux, KiB). The llamabind child's figure
includes the Python interpreter and numpy; their baseline (the same child without loading a
model) is reported beside it. Writes bench/results/memory-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import llamabind
from llamabind import models

HERE = Path(__file__).resolve().parent

CHILD = """
import resource, sys, llamabind
if sys.argv[1] != "-":
    m = llamabind.Model(sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=2)
    m.generate("Once upon a time", max_tokens=int(sys.argv[3]), temperature=0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def child_peak_kib(cmd: list[str]) -> int:
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if after <= before:
        raise RuntimeError("ru_maxrss of children did not grow: run this benchmark in a fresh process")
    return after


def rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "-m", default=models.DEFAULT)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    path = models.resolve(args.model)
    n_ctx, n_gen = 512 + 128, 128

    # children in increasing order of expected peak, since RUSAGE_CHILDREN keeps the maximum
    py_base = int(subprocess.run([sys.executable, "-c", CHILD, "-"], capture_output=True, text=True, check=True).stdout)
    bench = llamabind.tool_path("llama-bench")
    lb_peak = (
        child_peak_kib([str(bench), "-m", str(path), "-t", "2", "-p", "512", "-n", "128", "-r", "1"]) if bench else None
    )
    p = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(n_ctx), str(n_gen)], capture_output=True, text=True, check=True
    )
    ours_peak = int(p.stdout)

    m = llamabind.Model(path, n_ctx=1024, n_threads=2)
    for _ in range(20):  # warm-up: first-use allocations
        m.generate("The quick brown fox", max_tokens=args.max_tokens, temperature=0.8)
    start = rss_kib()
    samples = []
    for i in range(args.calls):
        m.generate("The quick brown fox", max_tokens=args.max_tokens, temperature=0.8, seed=i)
        if (i + 1) % 50 == 0:
            samples.append(rss_kib())
    drift = samples[-1] - start
    m.close()

    print(f"{'what':52} {'MiB':>8}")
    print(f"{'peak RSS, llama-bench pp512+tg128':52} {lb_peak / 1024 if lb_peak else float('nan'):8.1f}")
    print(f"{'peak RSS, llamabind load + generate 128 (incl. Python)':52} {ours_peak / 1024:8.1f}")
    print(f"{'  of which Python + numpy + llamabind import':52} {py_base / 1024:8.1f}")
    print(f"{'  llamabind less that baseline':52} {(ours_peak - py_base) / 1024:8.1f}")
    print(f"{f'RSS drift over {args.calls} generate calls':52} {drift / 1024:8.2f}")
    out = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "model": str(path),
        "llama_bench_peak_kib": lb_peak,
        "llamabind_peak_kib": ours_peak,
        "python_baseline_kib": py_base,
        "drift_kib": drift,
        "calls": args.calls,
        "rss_samples_kib": samples,
        "command": " ".join(sys.argv),
    }
    dest = HERE / "results" / f"memory-{socket.gethostname()}-{datetime.date.today()}.json"
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
