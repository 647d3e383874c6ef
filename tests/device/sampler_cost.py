"""Per-token cost of the sampler chain in the decode graph (issue 40): greedy generation with backend
sampling, with and without ignore_eos (which adds a logit bias: -inf on the end-of-generation tokens,
ggml's fill + set_rows + add over the vocabulary in the graph), against the decode alone, in one process
run, rounds interleaved. Prints the medians (us per token) and writes JSON.

    python3 tests/device/sampler_cost.py MODEL [-ngl 99] [--threads 8] [--rounds 5] [-n 128] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import llamabind
from llamabind.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from e2e import PROMPT, tg_loop  # noqa: E402  (bench/e2e.py: the decode-alone loop, its prompt)


def decode_alone(ctx: llamabind.Context, prompt: list[int], n: int) -> float:
    """us per token of bench/e2e.py's decode-alone loop."""
    return 1e6 / tg_loop(ctx, prompt, n)


def sampled(model: llamabind.Model, ctx: llamabind.Context, prompt: list[int], n: int, ignore_eos: bool) -> float:
    """us per token of sample + decode with the chain attached to the decode graph."""
    sampler = SamplingParams(temperature=0, ignore_eos=ignore_eos, backend_sampling=True).build(model)
    ctx.clear()
    sampler.accept(prompt)
    assert sampler.attach(ctx), "the chain did not attach (backend sampling unavailable)"
    ctx.decode(prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        ctx.decode([sampler.sample(ctx)])
    us = 1e6 * (time.perf_counter() - t0) / n
    sampler.close()
    return us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("-ngl", type=int, default=99)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    names = ["decode alone", "greedy in the graph", "greedy + logit bias (ignore_eos)"]
    rows: dict[str, list[float]] = {k: [] for k in names}
    with llamabind.Model(args.model, n_gpu_layers=args.ngl, n_threads=args.threads) as m:
        with m.context(n_ctx=512) as ctx:
            prompt = m.tokenize(PROMPT)
            sampled(m, ctx, prompt, 16, True)  # warm-up: pipelines, CUDA graphs
            for _ in range(args.rounds):
                rows["decode alone"].append(decode_alone(ctx, prompt, args.n))
                rows["greedy in the graph"].append(sampled(m, ctx, prompt, args.n, False))
                rows["greedy + logit bias (ignore_eos)"].append(sampled(m, ctx, prompt, args.n, True))
    base = statistics.median(rows["decode alone"])
    print(f"{args.model}: -ngl {args.ngl}, {args.rounds} rounds x {args.n} tokens, median us per token")
    print("| loop | us/token | min-max | over decode alone |\n|---|---|---|---|")
    for k, v in rows.items():
        med = statistics.median(v)
        print(f"| {k} | {med:.1f} | {min(v):.1f}-{max(v):.1f} | {med - base:+.1f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "ngl": args.ngl, "n": args.n, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
