#!/usr/bin/env python3
"""Sequence packing against padding (issue 84, patch 0096): the same documents trained a window each,
padded to ctx_size, and packed several to a window (best-fit decreasing, each attending only to itself).

    python bench/pack.py --model GGUF [--ctx 32768] [--steps 4] [--docs 400] [-ngl 99] [--lora-rank R]
        [--loss-chunk-tokens N] [--gradient-checkpointing] [--out F.json]

The documents are real text that ships with Python: the standard library's modules (``{"text"}`` rows,
one a file, in name order, those of at least 64 tokens), read with ``train.read_data`` as ``finetune``
reads a JSONL. Each mode runs ``--steps`` timed optimizer steps (full fine-tune, or LoRA with
--lora-rank; AdamW; the run's defaults: flash attention and BF16 products on a GPU) after one warm-up
step, on the first windows of its layout. Columns: window positions a second, labelled (trained) tokens a
second, the padding share of the positions, documents a window, the median step, the compute buffer
(llama_opt_get_stats). A step of either mode costs the same for the same window; what packing changes is
how many of its positions are documents. --loss-chunk-tokens (0: the logits whole; default automatic) and
--gradient-checkpointing pass TrainingArgs' fields of those names (issue 84, item 3: memory at long contexts).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np


def stdlib_jsonl(path: Path, limit: int) -> int:
    """The standard library's .py files as {"text"} rows (name order, at most ``limit``); returns the rows."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in files:
            if n >= limit:
                break
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if len(text) >= 400:
                f.write(json.dumps({"text": text}) + "\n")
                n += 1
    return n


def run_mode(model, examples, ctx: int, pack: bool, steps: int, lora_rank: int | None, memory: dict) -> dict:
    """One mode's timed steps; ``memory``: TrainingArgs' loss_chunk_tokens and gradient_checkpointing."""
    from llamabind import train

    pad = model.token_eos if model.token_eos is not None and model.token_eos >= 0 else 0
    if pack:
        win, lab, seg, cut = train.packed_windows(examples, ctx, pad)
    else:
        (win, lab, cut), seg = train.example_windows(examples, ctx, pad), None
    take = min(len(win), steps + 1)
    kw = dict(lora_rank=lora_rank) if lora_rank else {}
    adapter = None
    if lora_rank:
        with tempfile.TemporaryDirectory() as d:
            train.lora_init(model, f"{d}/a.gguf", lora_rank, 2.0 * lora_rank, ("attn_q", "attn_v"), 0)
            adapter = model.load_lora(f"{d}/a.gguf")
    times, labelled, losses = [], [], []
    with train.Trainer(model, ctx_size=ctx, batch_size=1, pack=pack, lr=1e-5, progress=False,
                       params="lora" if lora_rank else "model", adapter=adapter, **kw, **memory) as t:  # fmt: skip
        for i in range(take):
            j = [i]
            t0 = time.perf_counter()
            loss, _, n = t.step(win[j], lab[j], None if seg is None else seg[j])
            if i:
                times.append(time.perf_counter() - t0)
                labelled.append(n)
                losses.append(loss)
        stats = t.stats()
    step_s = statistics.median(times)
    docs = [int(s.max()) + 1 for s in seg[:take]] if seg is not None else [1] * take
    return {
        "mode": "packed" if pack else "padded", "windows": len(win), "examples_cut": cut, "steps": len(times),
        "step_ms": step_s * 1e3, "positions_per_s": ctx / step_s, "labelled_per_s": statistics.mean(labelled) / step_s,
        "padding": 1.0 - float((lab[:take] >= 0).mean()), "docs_per_window": statistics.mean(docs),
        "compute_buffer_mib": stats["compute_buffer_bytes"] / 2**20, "mean_loss": statistics.mean(losses),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="an F32 GGUF (full fine-tune) or any GGUF with --lora-rank")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--docs", type=int, default=400, help="standard-library modules read as documents")
    ap.add_argument("--modes", default="packed,padded")
    ap.add_argument("--lora-rank", type=int, default=None)
    ap.add_argument("-ngl", type=int, default=99)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--loss-chunk-tokens", type=int, default=None, help="0: the logits whole (default: automatic)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    memory = dict(loss_chunk_tokens=a.loss_chunk_tokens, gradient_checkpointing=a.gradient_checkpointing)
    import llamabind
    from llamabind import train

    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "stdlib.jsonl"
        n_docs = stdlib_jsonl(data, a.docs)
        with llamabind.Model(a.model, n_gpu_layers=a.ngl, use_mmap=False, repack=False, n_threads=a.threads) as m:
            examples = train.read_data(str(data), m)
            lengths = [len(e) for e in examples]
            print(f"{n_docs} documents, tokens: median {int(np.median(lengths))}, max {max(lengths)}, "
                  f"sum {sum(lengths)}", file=sys.stderr)  # fmt: skip
            rows = [
                run_mode(m, examples, a.ctx, mode == "packed", a.steps, a.lora_rank, memory)
                for mode in a.modes.split(",")
            ]
    print("| mode | ctx | windows | docs/window | padding | step ms | positions/s | labelled tokens/s | "
          "compute buffer MiB | mean loss |\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for r in rows:
        print(f"| {r['mode']} | {a.ctx} | {r['windows']} | {r['docs_per_window']:.1f} | {100 * r['padding']:.1f}% | "
              f"{r['step_ms']:.0f} | {r['positions_per_s']:,.0f} | {r['labelled_per_s']:,.0f} | "
              f"{r['compute_buffer_mib']:,.0f} | {r['mean_loss']:.4f} |")  # fmt: skip
    if a.out:
        doc = {"ctx": a.ctx, "model": a.model, "lengths": lengths, "rows": rows, **memory}
        Path(a.out).write_text(json.dumps(doc, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
