#!/usr/bin/env python3
"""Generation speed when the decoding thread changes (issue 20): a web app or ``asyncio.to_thread``
loads the model on one thread and generates on others. With OpenMP (ggml-cpu's default) each
thread that decodes keeps its own thread team; a team left behind made decodes on other threads
run several times slower once the process had more OpenMP threads than cores. llamabind frees
the calling thread's team when a generation ends (``llamabind.context.release_threads``).

    python bench/threads.py [--model NAME|PATH] [--threads 2] [--rounds 3] [-n 64]

Each round runs two fresh processes, alternating which goes first: one with the release off
("before": the feature modules' call replaced by a no-op) and one with it on ("after"). Each
makes a greedy generation of n tokens on the main thread, then one on each of two new threads
one after another, then one on a pool thread (concurrent.futures), then one on the main thread
again. The reference is the main thread's own rate in the same process (a team lives as long as
its thread, so the two modes cannot share a process).
Prints a table and writes bench/results/threads-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llamabind
from llamabind import batch, embeddings, generation, models

HERE = Path(__file__).resolve().parent
PROMPT = "Write a long story about a lighthouse keeper. Once upon a time,"
STEPS = ("main thread", "new thread 1", "new thread 2", "pool thread", "main thread again")


def tps(model: llamabind.Model, n: int) -> float:
    r = model.generate(PROMPT, max_tokens=n, temperature=0, ignore_eos=True)
    return r.timings.generated_tps


def on_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def worker(model_path: str, threads: int, n: int, release: bool) -> dict[str, float]:
    if not release:
        for mod in (generation, batch, embeddings):
            mod.release_threads = lambda: None  # type: ignore[attr-defined]
    model = llamabind.Model(model_path, n_threads=threads, n_gpu_layers=0)
    with ThreadPoolExecutor(max_workers=1) as pool:
        out = {
            STEPS[0]: tps(model, n),
            STEPS[1]: on_new_thread(lambda: tps(model, n)),
            STEPS[2]: on_new_thread(lambda: tps(model, n)),
            STEPS[3]: pool.submit(tps, model, n).result(),
            STEPS[4]: tps(model, n),
        }
    model.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "-m", default=models.DEFAULT)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--rounds", "-r", type=int, default=3)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", choices=("before", "after"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    path = str(models.resolve(args.model))
    if args.worker:
        print(json.dumps(worker(path, args.threads, args.n, args.worker == "after")))
        return 0
    res: dict[str, dict[str, list[float]]] = {k: {s: [] for s in STEPS} for k in ("before", "after")}
    for r in range(args.rounds):
        for mode in ("before", "after") if r % 2 == 0 else ("after", "before"):
            cmd = [sys.executable, __file__, "-m", path, "-t", str(args.threads), "-n", str(args.n), "--worker", mode]
            p = subprocess.run(cmd, capture_output=True, text=True, check=True)
            for step, v in json.loads(p.stdout.strip().splitlines()[-1]).items():
                res[mode][step].append(v)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    med = {mode: {s: statistics.median(v) for s, v in d.items()} for mode, d in res.items()}
    print("| step | before t/s | vs main | after t/s | vs main |")
    print("|---|---|---|---|---|")
    for s in STEPS:
        b, a = med["before"][s], med["after"][s]
        print(f"| {s} | {b:.1f} | {b / med['before'][STEPS[0]]:.3f} | {a:.1f} | {a / med['after'][STEPS[0]]:.3f} |")
    out = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "command": " ".join(sys.argv),
        "params": {"threads": args.threads, "rounds": args.rounds, "n": args.n},
        "compile_flags": llamabind.build_info()["compile_flags"],
        "median": med,
        "raw": res,
    }
    name = f"threads-{socket.gethostname()}-{datetime.date.today()}.json"
    dest = Path(args.out) if args.out else HERE / "results" / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
