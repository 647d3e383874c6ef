#!/usr/bin/env python3
"""Serving throughput and time to first token: `python -m llamabind serve` beside upstream's
llama-server built from the same tree, the same model, slots, context and threads, in one run.

    python bench/server.py [--model M] [--parallel 8] [--ctx 8192] [--threads 2] [-ngl 0]
                           [--clients 1,4,8] [--requests 4] [--max-tokens 64] [--rounds 3]
                           [--draft D [--draft-max 8] [--draft-min 1]]

With --draft both servers decode speculatively with the draft model D (llamabind serve --model-draft,
llama-server -md --spec-type draft-simple), and a third row is llamabind serve without it.

Both servers run as subprocesses for the whole run (an idle one waits on a condition variable and uses
no CPU); each round measures every (server, clients) cell in alternating server order. A client is a
thread that streams chat completions (SSE) one after another (`--requests` each, distinct prompts,
greedy, ``ignore_eos`` so every reply is --max-tokens tokens); TTFT is the time from sending a request
to its first content delta. Output tokens/s = the completion tokens of all clients / the cell's wall
time (from the first request to the last byte). Prints a table (median over rounds; p50/p99 TTFT over
all requests of all rounds) and writes bench/results/server-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def start_llamabind(args, draft: bool = True) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "llamabind", "serve", args.model, "--port", "0", "--parallel", str(args.parallel),
           "--ctx-size", str(args.ctx), "--threads", str(args.threads)]  # fmt: skip
    if args.ngl is not None:
        cmd += ["-ngl", str(args.ngl)]
    if args.draft and draft:
        cmd += ["--model-draft", args.draft, "--draft-max", str(args.draft_max), "--draft-min", str(args.draft_min)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while time.time() - t0 < 300:
        line = proc.stderr.readline()
        if not line:
            break
        m = re.search(r"at (http://\S+) ", line)
        if m:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # drain
            return proc, m.group(1)
    raise SystemExit("llamabind serve did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama_server(args, path: str) -> tuple[subprocess.Popen, str]:
    import llamabind

    exe = llamabind.tool_path("llama-server")
    if exe is None:
        raise SystemExit("llama-server not built: install with LLAMABIND_BUILD_TOOLS=ON (./dev setup does)")
    port = free_port()
    # the same settings as llamabind.serve: unified KV cache, metrics and slots endpoints on
    cmd = [str(exe), "-m", path, "--host", "127.0.0.1", "--port", str(port), "-np", str(args.parallel),
           "-c", str(args.ctx), "-t", str(args.threads), "--kv-unified", "--no-webui"]  # fmt: skip
    if args.ngl is not None:
        cmd += ["-ngl", str(args.ngl)]
    if args.draft:  # at this pin -md needs the type named; the draft's offload follows -ngl's default
        cmd += ["-md", args.draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.draft_max),
                "--spec-draft-n-min", str(args.draft_min)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < 300:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}")
        time.sleep(0.2)
    raise SystemExit("llama-server did not start")


def one_request(client: httpx.Client, url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(TTFT in seconds, completion tokens) of one streamed chat completion."""
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }  # fmt: skip
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ttft is None and ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens


def cell(url: str, model: str, clients: int, args, round_: int) -> dict:
    ttfts: list[float] = []
    tokens, failed = [0], [0]
    lock = threading.Lock()

    def worker(c: int) -> None:
        with httpx.Client(timeout=600) as h:
            for i in range(args.requests):
                prompt = f"Round {round_}, client {c}, request {i}: write a short story about the number {c * 100 + i}."
                try:
                    t, n = one_request(h, url, model, prompt, args.max_tokens)
                except httpx.HTTPError as e:  # counted and reported: the cell's tok/s is then not comparable
                    print(f"{url} client {c} request {i}: {type(e).__name__}: {e}", file=sys.stderr)
                    with lock:
                        failed[0] += 1
                    continue
                with lock:
                    ttfts.append(t)
                    tokens[0] += n

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tokens": tokens[0], "seconds": wall, "tok_s": tokens[0] / wall, "ttft": ttfts, "failed": failed[0]}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("-ngl", type=int, default=None)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=4, help="requests per client per cell")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--draft", default=None, help="a draft model: both servers decode speculatively (+ a row without)")
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--draft-min", type=int, default=1)
    args = ap.parse_args()
    from llamabind import models

    if args.draft:
        args.draft = str(models.resolve(args.draft))
    path = str(models.resolve(args.model))
    args.model = path
    levels = [int(c) for c in args.clients.split(",")]
    procs = {}
    try:
        procs["llamabind"] = start_llamabind(args)
        procs["llama-server"] = start_llama_server(args, path)
        if args.draft:
            procs["llamabind-nodraft"] = start_llamabind(args, draft=False)
        ids = {k: httpx.get(u + "/v1/models").json()["data"][0]["id"] for k, (_, u) in procs.items()}
        for k, (_, u) in procs.items():  # warm-up: first decode, allocations
            one_request(httpx.Client(timeout=600), u, ids[k], "Hello", 8)
        results: dict = {k: {c: [] for c in levels} for k in procs}
        for r in range(args.rounds):
            order = list(procs) if r % 2 == 0 else list(procs)[::-1]
            for c in levels:
                for k in order:
                    res = cell(procs[k][1], ids[k], c, args, r)
                    results[k][c].append(res)
                    print(f"round {r} {k:12s} clients={c}: {res['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for p, _ in procs.values():
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    rows = []
    for c in levels:
        for k in procs:
            cells = results[k][c]
            ttft = [t for x in cells for t in x["ttft"]]
            rows.append({
                "server": k, "clients": c, "tok_s": statistics.median(x["tok_s"] for x in cells),
                "tok_s_rounds": [round(x["tok_s"], 2) for x in cells],
                "ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99), "requests": len(ttft),
                "failed": sum(x["failed"] for x in cells),
            })  # fmt: skip
    by = {(r["server"], r["clients"]): r for r in rows}
    lines = [
        f"bench/server.py: {Path(path).name}, {args.parallel} slots, ctx {args.ctx}, {args.threads} threads, "
        f"-ngl {args.ngl}, {args.requests} x {args.max_tokens}-token streamed requests per client, "
        f"{args.rounds} rounds (median)"
        + (f"; draft {Path(args.draft).name} ({args.draft_min}-{args.draft_max} tokens)" if args.draft else ""),
        f"{'clients':>7} | {'server':12} | {'tok/s':>8} | {'TTFT p50 ms':>11} | {'TTFT p99 ms':>11} | ratio",
    ]
    for c in levels:
        ref = by[("llama-server", c)]["tok_s"]
        for k in procs:
            r = by[(k, c)]
            lines.append(
                f"{c:>7} | {k:12} | {r['tok_s']:8.1f} | {r['ttft_p50_ms']:11.1f} | {r['ttft_p99_ms']:11.1f} | "
                f"{r['tok_s'] / ref:.3f}" + (f" ({r['failed']} requests failed: not comparable)" if r["failed"] else "")
            )
    print("\n".join(lines))
    out = Path(args.out) if args.out else HERE / "results" / (
        f"server-{socket.gethostname().split('.')[0]}-{datetime.date.today().isoformat()}.json"
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    import llamabind

    out.write_text(json.dumps({
        "args": {k: v for k, v in vars(args).items()}, "rows": rows, "table": lines,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "build": {k: v for k, v in llamabind.build_info().items() if isinstance(v, (str, int, bool))},
    }, indent=1))  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
