#!/usr/bin/env python3
"""pp512 / tg128 and end-to-end generation: llamabind, upstream llama-bench (built from the same
vendored tree) and llama-cpp-python 0.3.36 (same llama.cpp commit, its own venv), interleaved
round by round in one run.

    python bench/generation.py [--model NAME|PATH] [--threads 2] [--rounds 3] [-p 512] [-n 128]
                               [-ngl 99] [--reps 1] [--bandwidth GB/s]

pp and tg follow llama-bench's own method (random tokens, BOS first; n_ctx = p + n; pp in n_batch
chunks, tg one token at a time from an empty cache); end-to-end is a streamed greedy completion of
a fixed prompt (tokenize, decode, sample, detokenize, stream), which llama-bench leaves out.
--reps N times N repetitions per round on both sides (llama-bench -r N, mean as its avg_ts): on a
GPU one pp512 takes milliseconds and one sample is noise. With --bandwidth (the device's measured
memory bandwidth, GB/s; bench/gpu_bandwidth.py measures it) the table also gives the fraction of it
that tg reaches, counting the bytes of every weight tensor read per token (all but the token
embedding table, of which one row is read).
Prints a table in llama-bench's format with ratios to llama-bench and writes
bench/results/<host>-<date>.json. Needs a build with tools (./dev setup does that) and, for the
third column, bench/.venv-llama-cpp-python (see bench/README.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llamabind
from llamabind import models

HERE = Path(__file__).resolve().parent
E2E_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. Once upon a time,"


def llamabind_round(
    model: llamabind.Model,
    n_prompt: int,
    n_gen: int,
    n_batch: int,
    n_ubatch: int,
    threads: int,
    seed: int,
    reps: int = 1,
) -> dict:
    rng = random.Random(seed)
    n_vocab = model.n_vocab
    bos = model.token_bos if model._llama_model.add_bos else None

    def prompt_tokens():
        toks = [rng.randrange(n_vocab) for _ in range(n_prompt)]
        if bos is not None:
            toks[0] = bos
        return toks

    # as llama-bench: each test in its own context of n_ctx = n_prompt + n_gen of that test
    with model.context(n_ctx=n_prompt, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads) as ctx:
        ctx.decode(prompt_tokens()[: min(n_prompt, n_batch)])  # warm-up, as llama-bench does
        pps = []
        for _ in range(reps):
            ctx.clear()
            toks = prompt_tokens()
            t0 = time.perf_counter()
            ctx.decode(toks)  # n_batch chunks inside, synchronized
            pps.append(n_prompt / (time.perf_counter() - t0))
    with model.context(n_ctx=n_gen, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads) as ctx:
        ctx.decode([bos if bos is not None else rng.randrange(n_vocab)])  # warm-up
        tgs = []
        for _ in range(reps):
            ctx.clear()
            tok = bos if bos is not None else rng.randrange(n_vocab)
            t0 = time.perf_counter()
            for _ in range(n_gen):
                ctx.decode([tok])
                tok = rng.randrange(n_vocab)
            tgs.append(n_gen / (time.perf_counter() - t0))
    pp, tg = statistics.mean(pps), statistics.mean(tgs)
    with model.context(n_ctx=n_prompt + n_gen, n_batch=n_batch, n_ubatch=n_ubatch, n_threads=threads) as ctx:
        t0 = time.perf_counter()
        stream = ctx.generate(E2E_PROMPT, max_tokens=n_gen, temperature=0, stream=True)
        text = "".join(stream)
        dt = time.perf_counter() - t0
        e2e = len(stream.result.tokens) / dt
    return {"pp": pp, "tg": tg, "e2e": e2e, "e2e_tokens": len(stream.result.tokens), "e2e_chars": len(text)}


def llama_bench_round(
    exe: Path,
    model_path: Path,
    n_prompt: int,
    n_gen: int,
    n_batch: int,
    n_ubatch: int,
    threads: int,
    n_gpu_layers: int = 99,
    reps: int = 1,
) -> dict:
    cmd = [
        str(exe),
        "-m",
        str(model_path),
        "-t",
        str(threads),
        "-p",
        str(n_prompt),
        "-n",
        str(n_gen),
        "-b",
        str(n_batch),
        "-ub",
        str(n_ubatch),
        "-ngl",
        str(n_gpu_layers),
        "-r",
        str(reps),
        "-o",
        "json",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {p.stderr[-500:]}")
    out = {}
    for r in json.loads(p.stdout):
        key = "pp" if r["n_prompt"] > 0 and r["n_gen"] == 0 else "tg"
        out[key] = r["avg_ts"]
        out["info"] = {
            k: r.get(k)
            for k in (
                "model_type",
                "model_size",
                "model_n_params",
                "backends",
                "n_threads",
                "n_batch",
                "n_ubatch",
                "flash_attn",
                "type_k",
                "cpu_info",
                "build_commit",
            )
        }
    return out


def llama_cpp_python_round(
    python: Path, model_path: Path, n_prompt: int, n_gen: int, n_batch: int, n_ubatch: int, threads: int, seed: int
) -> dict | None:
    if not python.exists():
        return None
    args = json.dumps(
        {
            "model": str(model_path),
            "n_prompt": n_prompt,
            "n_gen": n_gen,
            "n_batch": n_batch,
            "n_ubatch": n_ubatch,
            "threads": threads,
            "seed": seed,
            "prompt": E2E_PROMPT,
        }
    )
    p = subprocess.run(
        [str(python), str(HERE / "_llama_cpp_python_worker.py"), args], capture_output=True, text=True, timeout=1800
    )
    if p.returncode != 0:
        print(f"llama-cpp-python worker failed: {p.stderr[-800:]}", file=sys.stderr)
        return None
    return json.loads(p.stdout.strip().splitlines()[-1])


def bytes_read_per_token(path: Path) -> int:
    """Weight bytes one decoded token reads: every tensor but the token embedding table (get_rows reads
    one row of it), unless the output projection is tied to it (then it is read whole)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "-m", default=models.DEFAULT)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--rounds", "-r", type=int, default=3)
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-b", "--batch-size", type=int, default=2048)
    ap.add_argument("-ub", "--ubatch-size", type=int, default=512)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=99, help="llama-bench's -ngl (99: all; -1 here)")
    ap.add_argument("--reps", type=int, default=1, help="timed repetitions per round and side (llama-bench -r)")
    ap.add_argument("--bandwidth", type=float, default=None, help="the device's measured memory bandwidth, GB/s")
    ap.add_argument("--llama-cpp-python", default=str(HERE / ".venv-llama-cpp-python" / "bin" / "python"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    bench = llamabind.tool_path("llama-bench")
    if bench is None:
        print("llama-bench is not in this build: install with LLAMABIND_BUILD_TOOLS=ON (./dev setup)", file=sys.stderr)
        return 2
    model_path = models.resolve(args.model)
    p, n, b, ub, t = args.n_prompt, args.n_gen, args.batch_size, args.ubatch_size, args.threads
    ngl = -1 if args.n_gpu_layers >= 99 else args.n_gpu_layers
    model = llamabind.Model(model_path, n_threads=t, n_gpu_layers=ngl)
    res: dict[str, dict[str, list]] = {
        k: {"pp": [], "tg": [], "e2e": []} for k in ("llama-bench", "llamabind", "llama-cpp-python")
    }
    info = {}

    def run_llama_bench(r):
        nonlocal info
        lb = llama_bench_round(bench, model_path, p, n, b, ub, t, args.n_gpu_layers, args.reps)
        info = lb.pop("info")
        for k, v in lb.items():
            res["llama-bench"][k].append(v)

    def run_llamabind(r):
        for k, v in llamabind_round(model, p, n, b, ub, t, seed=r, reps=args.reps).items():
            res["llamabind"].setdefault(k, []).append(v)

    def run_llama_cpp_python(r):
        lcp = llama_cpp_python_round(Path(args.llama_cpp_python), model_path, p, n, b, ub, t, seed=r)
        for k, v in (lcp or {}).items():
            res["llama-cpp-python"].setdefault(k, []).append(v)

    order = [run_llama_bench, run_llamabind, run_llama_cpp_python]
    for r in range(args.rounds):  # interleaved, alternating order: A B C, C B A, A B C, ...
        for fn in order if r % 2 == 0 else order[::-1]:
            fn(r)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    med = {
        impl: {k: statistics.median(v) for k, v in d.items() if v and isinstance(v[0], (int, float))}
        for impl, d in res.items()
    }
    size_gib = info.get("model_size", 0) / 2**30
    params_b = info.get("model_n_params", 0) / 1e9
    read = bytes_read_per_token(model_path)
    bw_col = args.bandwidth is not None
    header = "| model | size | params | backend | threads | test | impl | t/s | vs llama-bench |"
    if bw_col:
        header += " GB/s (tg) | of measured bandwidth |"
    print(header)
    print("|" + "|".join("---" for _ in header.split("|")[1:-1]) + "|")
    rows = []
    for test, key in ((f"pp{p}", "pp"), (f"tg{n}", "tg"), (f"e2e{n}", "e2e")):
        for impl in ("llama-bench", "llamabind", "llama-cpp-python"):
            v = med[impl].get(key)
            if v is None:
                continue
            ref = med["llama-bench"].get(key)
            ratio = f"{v / ref:.3f}" if ref else "-"
            if key == "e2e" and impl == "llamabind" and med["llama-cpp-python"].get("e2e"):
                ratio = f"{v / med['llama-cpp-python']['e2e']:.2f}x llama-cpp-python"
            row = {"test": test, "impl": impl, "tps": v, "ratio": ratio}
            line = (
                f"| {info.get('model_type', '?')} | {size_gib:.2f} GiB | {params_b:.2f} B "
                f"| {info.get('backends', '?')} "
                f"| {t} | {test} | {impl} | {v:.2f} | {ratio} |"
            )
            if bw_col:
                gbs = v * read / 1e9 if key == "tg" else None
                row.update(gbs=gbs, bandwidth_fraction=gbs / args.bandwidth if gbs else None)
                line += f" {gbs:.0f} | {gbs / args.bandwidth:.1%} |" if gbs else " - | - |"
            rows.append(row)
            print(line)
    out = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "machine": platform.machine(),
        "command": " ".join(sys.argv),
        "model": str(model_path),
        "params": {"n_prompt": p, "n_gen": n, "n_batch": b, "n_ubatch": ub, "threads": t, "rounds": args.rounds},
        "llama_bench_info": info,
        "build_info": {k: v for k, v in llamabind.build_info().items() if k != "devices"},
        "median": med,
        "raw": res,
        "table": rows,
        "bytes_read_per_token": read,
        "measured_bandwidth_gbs": args.bandwidth,
    }
    path = Path(args.out) if args.out else HERE / "results" / f"{socket.gethostname()}-{datetime.date.today()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
