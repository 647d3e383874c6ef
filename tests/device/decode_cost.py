"""Per-call cost of a single-token decode: llamabind vs llama-bench vs llama.h alone (issue 6).

On the H200 the micro model (6 M parameters) ran tg128 at 5993 t/s in llama-bench and 5004 t/s through
llamabind: ~33 us more per token, about the gap of the 1B Q4_0 row. This measures, in one process run:
llama-bench tg128 (20 reps), tests/device/decode_cost.cpp (llama.h alone, one context setting changed
at a time), and llamabind's Context.decode and _core.Context.decode in the same loop (median us/token).

    python3 tests/device/decode_cost.py MODEL --build-dir build/cp312-cp312-linux_x86_64 [-ngl 99] [--threads 8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from rss_probe import build_native  # noqa: E402

import llamabind  # noqa: E402


def llamabind_us_per_token(model: llamabind.Model, threads: int) -> dict[str, float]:
    rng = random.Random(0)
    out = {}
    with model.context(n_ctx=128, n_threads=threads) as ctx:
        ctx.decode([1])
        for label, fn in [
            ("llamabind Context.decode", ctx.decode),
            ("llamabind _core.Context.decode", ctx._llama_context.decode),
        ] * 2:
            us = []
            for _ in range(20):
                ctx.clear()
                t0 = time.perf_counter()
                for _ in range(128):
                    fn([rng.randrange(model.n_vocab)])
                us.append((time.perf_counter() - t0) / 128 * 1e6)
            out.setdefault(label, []).append(statistics.median(us))
    return {k: min(v) for k, v in out.items()}


def llama_bench_us_per_token(model_path: str, ngl: int, threads: int, env: dict | None = None) -> float:
    exe = llamabind.tool_path("llama-bench")
    p = subprocess.run(
        [
            str(exe),
            "-m",
            model_path,
            "-ngl",
            str(ngl),
            "-t",
            str(threads),
            "-p",
            "0",
            "-n",
            "128",
            "-r",
            "20",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**__import__("os").environ, **(env or {})},
    )
    return 1e6 / json.loads(p.stdout)[0]["avg_ts"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--build-dir", type=Path, required=True)
    ap.add_argument("-ngl", type=int, default=99)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows: dict[str, float] = {"llama-bench tg128": llama_bench_us_per_token(a.model, a.ngl, a.threads)}
    exe = build_native(a.build_dir, "decode_cost.cpp")
    p = subprocess.run([str(exe), a.model, str(a.ngl), str(a.threads)], capture_output=True, text=True, check=True)
    for line in p.stdout.strip().split("\n"):
        name, us = line.rsplit(None, 2)[0].strip(), float(line.split()[-2])
        rows[f"llama.h: {name}"] = us
    model = llamabind.Model(a.model, n_gpu_layers=-1 if a.ngl >= 99 else a.ngl, n_threads=a.threads)
    rows.update(llamabind_us_per_token(model, a.threads))
    model.close()
    rows["llama-bench tg128 (again)"] = llama_bench_us_per_token(a.model, a.ngl, a.threads)
    base = rows["llama-bench tg128"]
    for k, v in rows.items():
        print(f"{k:45} {v:8.1f} us/token  {v - base:+7.1f}")
    if a.out:
        a.out.write_text(
            json.dumps({"model": a.model, "ngl": a.ngl, "threads": a.threads, "us_per_token": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
