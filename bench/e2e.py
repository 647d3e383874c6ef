#!/usr/bin/env python3
"""End-to-end generation vs the decode alone, with the per-token breakdown (issue 20).

    python bench/e2e.py [--model NAME|PATH] [-ngl 99] [--threads 2] [--rounds 3] [-n 128]

Greedy generation of n tokens (ignore_eos) after a fixed prompt, in one process run, rounds
interleaved in alternating order, every context of n_ctx = prompt + n tokens (llama-bench's
``-p 0 -n n -d len(prompt)``: the same KV cells attended to; with a larger n_ctx than llama-bench's the
decode reads more of the cache per token and looks slower than it is):
- tg: llamabind's decode alone, one token at a time, by llama-bench's method (--reps runs from the
  prompt's cache, the first right after the prompt; the mean of their t/s), and the first run's extra
  time (the one-token graph rebuilt after the prompt's: what each generate pays once);
- llama-bench tg (the same tree's tool, the decode-only limit) and llama-completion (upstream's own
  end-to-end loop: n / (total - prompt eval - load) of its common_perf_print);
- llamabind's generation loop taken apart (decode, sample, detokenize, the rest: Python), with the
  sampler chain on the CPU (common_sampler over the logits copied to the host) and in the decode
  graph (backend sampling, llama_set_sampler: only the token comes back);
- ``Model.generate(stream=True)`` as a user runs it, both ways: tokens / generation time
  (Timings.generated_tps: first sample to last token).
Prints a table (t/s; the median of each round's ratio to that round's llama-bench tg, its min-max,
the t/s spread as IQR / median; us per token of each part) and writes
bench/results/e2e-<host>-<date>.json; bench/compare.py OLD.json NEW.json --relative-to "tg (llama-bench)"
compares two of them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import llamabind
from llamabind import models
from llamabind.generation import TextState
from llamabind.sampling import SamplingParams

HERE = Path(__file__).resolve().parent
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. Once upon a time,"


def tg_loop(ctx: llamabind.Context, prompt: list[int], n: int, reps: int) -> dict:
    """llama-bench's tg at depth len(prompt) (``-p 0 -n n -d depth -r reps``), call for call: the prompt
    decoded untimed, then ``reps`` runs of n one-token decodes, each from the prompt's cache (llama-bench
    restores the depth's saved state between its reps, nothing decoded in between; here the generated
    tail is dropped with truncate). t/s as llama-bench's avg_ts: the mean of the reps' t/s.

    Only the first rep follows the prompt's many-token graph: its first decode rebuilds the one-token
    graph, and on CUDA runs it eagerly and captures a new CUDA graph on the next (ggml-cuda's warm-up
    after a change). ``first_rep_extra_us`` is that rep's time over the later reps' mean: what every
    ``generate`` pays once after its prompt, in llama-bench's first rep only."""
    ctx.clear()
    ctx.decode(prompt)
    tok = prompt[-1]
    rates = []
    for i in range(reps):
        if i:
            ctx.truncate(len(prompt))
        t0 = time.perf_counter()
        for _ in range(n):
            ctx.decode([tok])
        rates.append(n / (time.perf_counter() - t0))
    later = statistics.mean(rates[1:]) if reps > 1 else rates[0]
    return {"tps": statistics.mean(rates), "first_rep_extra_us": (n / rates[0] - n / later) * 1e6}


def stepwise(model: llamabind.Model, ctx: llamabind.Context, prompt: list[int], n: int, on_device: bool) -> dict:
    """The generation loop of llamabind.generation, each part timed (us per token)."""
    sampler = SamplingParams(temperature=0, ignore_eos=True, backend_sampling=on_device).build(model)
    text = TextState(model, [])
    ctx.clear()
    sampler.accept(prompt)
    attached = sampler.attach(ctx) if on_device else False
    ctx.decode(prompt)
    dec = smp = txt = 0.0
    pc = time.perf_counter
    t0 = pc()
    for _ in range(n):
        a = pc()
        tok = sampler.sample(ctx)
        b = pc()
        text.feed(tok)
        c = pc()
        ctx.decode([tok])
        d = pc()
        smp += b - a
        txt += c - b
        dec += d - c
    total = pc() - t0
    sampler.close()
    us = 1e6 / n
    return {
        "tps": n / total,
        "decode_us": dec * us,
        "sample_us": smp * us,
        "detokenize_us": txt * us,
        "python_us": (total - dec - smp - txt) * us,
        "attached": attached,
    }


def generate_tps(model: llamabind.Model, ctx: llamabind.Context, n: int, on_device: bool) -> tuple[float, list[int]]:
    stream = ctx.generate(PROMPT, max_tokens=n, temperature=0, ignore_eos=True, backend_sampling=on_device, stream=True)
    for _ in stream:
        pass
    assert stream.result is not None
    return stream.result.timings.generated_tps, stream.result.tokens


def llama_bench_tg(path: Path, n: int, depth: int, threads: int, ngl: int, reps: int) -> float:
    exe = llamabind.tool_path("llama-bench")
    cmd = [str(exe), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(n), "-d", str(depth), "-r", str(reps)]
    cmd += ["-ngl", str(ngl), "-o", "json"]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(p.stdout)[0]["avg_ts"]


def llama_completion(path: Path, n: int, n_ctx: int, threads: int, ngl: int) -> dict:
    exe = llamabind.tool_path("llama-completion")
    cmd = [str(exe), "-m", str(path), "-no-cnv", "-n", str(n), "--temp", "0", "--ignore-eos", "-t", str(threads)]
    cmd += ["-c", str(n_ctx)]
    cmd += ["-ngl", str(ngl), "-p", PROMPT]
    # a random-weight model's text need not be UTF-8
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=True, timeout=1800)
    ms = {}
    for key in ("prompt eval time", "eval time", "total time", "sampling time"):
        m = re.search(rf"common_perf_print:\s+{key} =\s+([\d.]+) ms", p.stderr)
        if m:
            ms[key] = float(m.group(1))
    runs = int(re.search(r"eval time =\s+[\d.]+ ms /\s+(\d+) runs", p.stderr).group(1))
    # generated tokens: the eval runs + the first one, sampled from the prompt's logits
    return {"tps": (runs + 1) / ((ms["total time"] - ms["prompt eval time"]) / 1e3), "ms": ms}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", "-m", default=models.DEFAULT)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--rounds", "-r", type=int, default=10, help="rounds, interleaved ABAB (default 10)")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5, help="tg runs per round on both sides (llama-bench -r, default 5)")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=99, help="99: all layers")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = models.resolve(args.model)
    n, t = args.n, args.threads
    model = llamabind.Model(path, n_threads=t, n_gpu_layers=-1 if args.n_gpu_layers >= 99 else args.n_gpu_layers)
    prompt = model.tokenize(PROMPT)
    # the context llama-bench makes for "-p 0 -n n -d len(prompt)": n_ctx = depth + n, the prompt
    # decoded first (its time left out); the attention then spans as many KV cells on both sides
    n_ctx = len(prompt) + n
    ctx = model.context(n_ctx=n_ctx, n_threads=t)
    res: dict[str, list] = {}

    def add(key, v):
        res.setdefault(key, []).append(v)

    tokens = {}
    steps = [
        lambda: add("tg (llama-bench)", llama_bench_tg(path, n, len(prompt), t, args.n_gpu_layers, args.reps)),
        lambda: add("e2e (llama-completion)", llama_completion(path, n, n_ctx + 1, t, args.n_gpu_layers)),
        lambda: add("tg (llamabind decode)", tg_loop(ctx, prompt, n, args.reps)),
        lambda: add("loop, CPU sampling", stepwise(model, ctx, prompt, n, False)),
        lambda: add("loop, backend sampling", stepwise(model, ctx, prompt, n, True)),
    ]
    for on_device in (False, True):

        def gen(on_device=on_device):
            tps, toks = generate_tps(model, ctx, n, on_device)
            add(f"generate, {'backend' if on_device else 'CPU'} sampling", tps)
            tokens[on_device] = toks

        steps.append(gen)
    generate_tps(model, ctx, 8, True)  # warm-up both graphs
    generate_tps(model, ctx, 8, False)
    for r in range(args.rounds):
        for fn in steps if r % 2 == 0 else steps[::-1]:
            fn()
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    def tps(v):
        return v["tps"] if isinstance(v, dict) else v

    med = {k: statistics.median(tps(x) for x in v) for k, v in res.items()}
    parts = {}
    for k in ("loop, CPU sampling", "loop, backend sampling"):
        parts[k] = {
            p: statistics.median(x[p] for x in res[k]) for p in ("decode_us", "sample_us", "detokenize_us", "python_us")
        }
        parts[k]["attached"] = all(x["attached"] for x in res[k]) if "backend" in k else False
    # each round's ratio to that round's llama-bench (the host's state in a round moves both alike)
    ratios = {k: [tps(x) / tps(b) for x, b in zip(v, res["tg (llama-bench)"])] for k, v in res.items()}
    stats = {}
    for k, v in res.items():
        xs = [tps(x) for x in v]
        q = statistics.quantiles(xs, n=4) if len(xs) >= 4 else [min(xs), 0, max(xs)]
        stats[k] = {
            "median_ratio": statistics.median(ratios[k]),
            "ratio_min": min(ratios[k]),
            "ratio_max": max(ratios[k]),
            "spread": (q[2] - q[0]) / statistics.median(xs),  # interquartile range over the median
        }
    print(f"model {path.name}, -ngl {args.n_gpu_layers}, {t} threads, n={n}, {args.rounds} rounds (median)")
    print(
        "| run | t/s | vs llama-bench tg (per-round median) | min-max | spread (IQR) "
        "| decode us | sample us | detokenize us | python us |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for k, v in med.items():
        p, st = parts.get(k), stats[k]
        cols = (
            f"{p['decode_us']:.1f} | {p['sample_us']:.1f} | {p['detokenize_us']:.1f} | {p['python_us']:.1f}"
            if p
            else "- | - | - | -"
        )
        print(
            f"| {k} | {v:.1f} | {st['median_ratio']:.3f} | {st['ratio_min']:.3f}-{st['ratio_max']:.3f} | "
            f"{100 * st['spread']:.1f}% | {cols} |"
        )
    extra = statistics.median(x["first_rep_extra_us"] for x in res["tg (llamabind decode)"])
    print(f"first tg run after the prompt, extra time over the later runs (median): {extra:.0f} us")
    same = tokens.get(False) == tokens.get(True)
    print(f"greedy tokens equal with CPU and backend sampling: {same}")
    out = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "command": " ".join(sys.argv),
        "model": str(path),
        "params": {
            "n": n,
            "n_ctx": n_ctx,
            "depth": len(prompt),
            "threads": t,
            "n_gpu_layers": args.n_gpu_layers,
            "rounds": args.rounds,
            "reps": args.reps,
        },
        "build_info": {k: v for k, v in llamabind.build_info().items() if k != "devices"},
        "devices": [d["description"] for d in llamabind.devices()],
        "median_tps": med,
        "ratio_to_llama_bench": stats,
        "per_token_us": parts,
        "first_rep_extra_us": extra,
        "greedy_tokens_equal": same,
        "raw": res,
    }
    name = f"e2e-{socket.gethostname()}-{path.stem}-{datetime.date.today()}.json"
    dest = Path(args.out) if args.out else HERE / "results" / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest}")
    ctx.close()
    model.close()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
