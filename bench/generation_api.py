"""Prompt-prefix reuse and batched generation, each beside its plain counterpart in one run.

- prefix reuse: a follow-up prompt that extends the previous one (a chat's second turn). With
  reuse the context evaluates only the new tokens; the counterpart is a fresh context per call.
  Reports prompt tokens evaluated (llama.cpp's n_p_eval) and prompt time.
- batched generation: N prompts through Model.generate_batch (one llama_decode per step for all
  sequences) against generating them one after another; reports total tokens/s.
- logits processors: greedy tg of 128 tokens with no processor, an identity processor and a
  mask processor (all but 1,000 tokens set to -inf, as a constrained-decoding library does);
  reports ms per token and the cost per token against no processor (target: identity <= 5%).
- KV cache types: pp512 (one 512-token eval) and tg128 (greedy, ignore_eos) with the KV cache in
  f16, q8_0 (K and V), q8_0 K + f16 V and q4_0, and the cache's state size after 640 tokens.

    .venv/bin/python bench/generation_api.py [--model PATH] [--threads 2] [--rounds 3]
Writes bench/results/generation-api-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import llamabind

BASE = "You are a helpful assistant. " * 20 + "Question: what are the three primary colors?"
FOLLOW = BASE + " Answer: red, yellow and blue. Question: and the secondary colors?"
PROMPTS = [
    "The three primary colors are",
    "Paris is the capital of",
    "def fibonacci(n):",
    "Once upon a time",
    "The quick brown fox",
    "In 1492, Columbus",
    "Water boils at",
    "The largest planet is",
]


def prefix_reuse(m, rounds):
    rows = []
    for mode in ("reuse", "fresh"):
        times, evals = [], []
        for _ in range(rounds):
            with m.context(n_ctx=1024) as c:
                c.generate(BASE, max_tokens=1, temperature=0)
                if mode == "fresh":
                    c.clear()
                c._llama_context.perf_reset()
                t = time.perf_counter()
                r = c.generate(FOLLOW, max_tokens=1, temperature=0)
                times.append((time.perf_counter() - t) * 1e3)
                evals.append(c._llama_context.perf()["n_p_eval"])
        rows.append(
            {
                "mode": mode,
                "prompt_tokens": r.prompt_tokens,
                "evaluated": evals[-1],
                "reused": r.timings.prompt_reused,
                "ms_median": statistics.median(times),
            }
        )
    return rows


def batched(m, n, max_tokens, rounds):
    prompts = PROMPTS[:n]
    out = {}
    for mode in ("batch", "sequential") * rounds:
        t = time.perf_counter()
        if mode == "batch":
            rs = m.generate_batch(prompts, max_tokens=max_tokens, temperature=0, ignore_eos=True)
        else:
            rs = []
            for p in prompts:
                with m.context(n_ctx=512) as c:
                    rs.append(c.generate(p, max_tokens=max_tokens, temperature=0, ignore_eos=True))
        dt = time.perf_counter() - t
        out.setdefault(mode, []).append(sum(len(r.tokens) for r in rs) / dt)
    return {k: statistics.median(v) for k, v in out.items()}


def processor_cost(m, max_tokens, rounds):
    """ms per generated token with no / an identity / a masking logits processor."""
    import numpy as np

    keep = np.arange(0, m.n_vocab, max(1, m.n_vocab // 1000))
    mask = np.full(m.n_vocab, -np.inf, np.float32)
    mask[keep] = 0.0
    procs = {"none": None, "identity": lambda ids, logits: logits, "mask 1000": lambda ids, logits: logits + mask}
    out: dict[str, list[float]] = {}
    names = list(procs)
    with m.context(n_ctx=512) as c:
        c.generate(PROMPTS[0], max_tokens=8, temperature=0)  # warm up
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                res = c.generate(PROMPTS[0], max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                 logits_processor=procs[name])  # fmt: skip
                out.setdefault(name, []).append(res.timings.generate_ms / len(res.tokens))
    med = {k: statistics.median(v) for k, v in out.items()}
    return {k: {"ms_per_token": v, "overhead": v / med["none"] - 1} for k, v in med.items()}


def kv_types(m, rounds):
    """pp512 and tg128 tokens/s and the state size (MiB) per KV cache type."""
    import numpy as np

    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, m.n_vocab - 100, 512)]
    types = [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f16"), ("q4_0", "q4_0")]
    out: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for tk, tv in types if r % 2 == 0 else types[::-1]:
            row = out.setdefault(f"{tk}/{tv}", {"pp512": [], "tg128": [], "state_mib": []})
            with m.context(n_ctx=1024, type_k=tk, type_v=tv) as c:
                t = time.perf_counter()
                c.eval(prompt)
                row["pp512"].append(512 / (time.perf_counter() - t))
                g = c.generate(prompt, max_tokens=128, temperature=0, ignore_eos=True)
                row["tg128"].append(len(g.tokens) / (g.timings.generate_ms / 1e3))
                row["state_mib"].append(len(c.save_state()) / 2**20)
    return {k: {m_: statistics.median(v) for m_, v in row.items()} for k, row in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=llamabind.models.DEFAULT)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    a = ap.parse_args()
    with llamabind.Model(a.model, n_threads=a.threads) as m:
        reuse = prefix_reuse(m, a.rounds)
        print(f"prefix reuse ({m.description}):")
        print(f"{'mode':<8} {'prompt':>7} {'evaluated':>9} {'reused':>7} {'ms':>8}")
        for r in reuse:
            print(f"{r['mode']:<8} {r['prompt_tokens']:>7} {r['evaluated']:>9} {r['reused']:>7} {r['ms_median']:>8.1f}")
        print(f"speed-up of the follow-up prompt: {reuse[1]['ms_median'] / reuse[0]['ms_median']:.2f}x")
        bat = {}
        print(f"\nbatched generation, {a.max_tokens} tokens per prompt (total tokens/s):")
        print(f"{'prompts':>7} {'batch':>8} {'sequential':>10} {'ratio':>6}")
        for n in (2, 4, 8):
            b = batched(m, n, a.max_tokens, a.rounds)
            bat[n] = b
            print(f"{n:>7} {b['batch']:>8.1f} {b['sequential']:>10.1f} {b['batch'] / b['sequential']:>6.2f}")
        proc = processor_cost(m, 128, a.rounds)
        print("\nlogits processors, greedy tg128 (ms per token):")
        print(f"{'processor':<10} {'ms/token':>8} {'cost':>7}")
        for k, v in proc.items():
            print(f"{k:<10} {v['ms_per_token']:>8.3f} {100 * v['overhead']:>6.1f}%")
        kv = kv_types(m, a.rounds)
        print("\nKV cache types (pp512, tg128 tokens/s; state after 640 tokens):")
        print(f"{'K/V':<10} {'pp512':>8} {'tg128':>8} {'MiB':>7}")
        for k, v in kv.items():
            print(f"{k:<10} {v['pp512']:>8.1f} {v['tg128']:>8.1f} {v['state_mib']:>7.2f}")
        res = {
            "model": str(m.path.name),
            "description": m.description,
            "threads": a.threads,
            "rounds": a.rounds,
            "prefix_reuse": reuse,
            "batched_tokens_per_s": bat,
            "logits_processor_tg128": proc,
            "kv_cache_types": kv,
            "host": platform.node(),
            "date": datetime.date.today().isoformat(),
            "llamabind": llamabind.build_info()["upstream_release"],
        }
    out = Path(__file__).parent / "results" / f"generation-api-vm-{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
