#!/usr/bin/env python3
"""Generation over ggml RPC on loopback: local only vs one and two RPC servers, with the bytes that
cross the sockets per generated token.

    python bench/rpc.py [--model NAME|PATH] [--rounds 3] [-p 128] [-n 64] [--threads 2]

Each configuration loads the model with n_gpu_layers=-1 (every layer on the servers' devices when
there are servers; the CPU-only local run keeps them local), then times pp (one n_batch decode of
p random tokens) and tg (n single-token decodes), as llama-bench does. The servers are
`python -m llamabind rpc-server` processes on CPU (llamabind.rpc.serve); bytes per token are the
bytes sent + received on the servers' TCP connections during tg (kernel tcp_info via `ss -tin`),
divided by n. Configurations
alternate round by round in one run. Prints a table and writes JSON (bench/results/rpc-<host>-<date>.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import socket
import statistics
import sys
import time
from pathlib import Path

import llamabind
from llamabind import models, rpc

HERE = Path(__file__).resolve().parent


def socket_bytes(port: int) -> int:
    """Bytes sent + received by the server's side of its TCP connections (ss -tin: tcp_info)."""
    import re
    import subprocess

    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True
    ).stdout
    return sum(int(v) for v in re.findall(r"bytes_(?:sent|received):(\d+)", out))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(model_path: Path, n_servers: int, p: int, n: int, threads: int, seed: int) -> dict:
    servers = [rpc.serve(port=free_port(), device="CPU", threads=threads) for _ in range(n_servers)]
    try:
        rng = random.Random(seed)
        with llamabind.Model(model_path, n_threads=threads, rpc=[s.endpoint for s in servers]) as m:
            nv = m.n_vocab
            with m.context(n_ctx=p + n, n_batch=p, n_ubatch=p, n_threads=threads) as c:
                c.decode([rng.randrange(nv) for _ in range(8)])  # warm-up
                c.clear()
                t0 = time.perf_counter()
                c.decode([rng.randrange(nv) for _ in range(p)])
                pp = p / (time.perf_counter() - t0)
                c.clear()
                ports = [int(s.endpoint.rsplit(":", 1)[1]) for s in servers]
                before = sum(socket_bytes(port) for port in ports)
                t0 = time.perf_counter()
                for _ in range(n):
                    c.decode([rng.randrange(nv)])
                tg = n / (time.perf_counter() - t0)
                moved = sum(socket_bytes(port) for port in ports) - before
        return {"pp": pp, "tg": tg, "bytes_per_token": moved / n}
    finally:
        for s in servers:
            s.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "-m", default=models.DEFAULT)
    ap.add_argument("--rounds", "-r", type=int, default=3)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model_path = models.resolve(args.model)
    configs = {"local": 0, "1 RPC server": 1, "2 RPC servers": 2}
    res: dict[str, list[dict]] = {k: [] for k in configs}
    for r in range(args.rounds):
        for name in list(configs) if r % 2 == 0 else list(configs)[::-1]:
            res[name].append(one_round(model_path, configs[name], args.n_prompt, args.n_gen, args.threads, seed=r))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("pp", "tg", "bytes_per_token")} for k, v in res.items()}
    print(f"| config | pp{args.n_prompt} t/s | tg{args.n_gen} t/s | tg vs local | bytes per generated token |")
    print("|---|---|---|---|---|")
    for k, v in med.items():
        print(
            f"| {k} | {v['pp']:.1f} | {v['tg']:.1f} | {v['tg'] / med['local']['tg']:.3f} | {v['bytes_per_token']:.0f} |"
        )
    out = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "command": " ".join(sys.argv),
        "model": str(model_path),
        "params": vars(args),
        "median": med,
        "raw": res,
    }
    path = Path(args.out) if args.out else HERE / "results" / f"rpc-{socket.gethostname()}-{datetime.date.today()}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
