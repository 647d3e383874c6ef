#!/usr/bin/env python3
"""Fine-tuning throughput and peak memory: llamabind (full and LoRA), upstream's llama-finetune built
from the same tree, and PyTorch on the CPU (transformers' LlamaForCausalLM from the same F32 GGUF), in
one run, on the same windows of the same text.

    python bench/train.py [--threads 2] [--ctx 256] [--chars 12000] [-ngl 0] [--torch PYTHON]
                          [--runners full,lora,qlora]

The data is the pinned tree's docs/build.md (its first --chars characters; repeated to reach a
larger --chars: on a GPU llama-finetune's epoch must last long enough for its whole-second
timings), cut as upstream's
common_opt_dataset_init does: windows of ctx + 1 tokens every ctx / 2, the last 10% held out for
validation; one AdamW step (lr 1e-5) per window, in order, 1 epoch. Every runner is its own process, so its
peak RSS (ru_maxrss; llama-finetune runs first, as this process's first child) is its own. Tokens/s counts the training
tokens (ctx per window) over the time of the epoch: its training and validation windows, as
llama-finetune's progress bars time them (whole seconds there); "train tok/s" counts the training
steps only (llamabind's and PyTorch's).
--torch: a python with torch + transformers + accelerate (tests/embed/requirements.txt: the side
venv the tests build); without it the PyTorch row is left out. Prints a table and writes
bench/results/train-<host>-<date>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LR = 1e-5


def worker_llamabind(args) -> dict:
    import llamabind
    from llamabind import train

    text = Path(args.data).read_text(encoding="utf-8")
    lora = args.mode == "lora"
    kw = dict(n_threads=args.threads, n_gpu_layers=args.ngl, repack=False)
    t0 = time.perf_counter()
    with llamabind.Model(args.model, use_mmap=lora, **kw) as m:
        t_load = time.perf_counter() - t0
        r = train.finetune(
            m, text, ctx_size=args.ctx, lr=LR if not lora else 1e-4, val_split=0.1, progress=False,
            n_threads=args.threads, lora_rank=8 if lora else None, shuffle=False,
        )  # fmt: skip
    e = r.epochs[0]
    wall = time.perf_counter() - t0 - t_load
    return dict(
        steps=r.steps, tokens=r.steps * args.ctx, seconds=e.seconds + e.val_seconds, wall_with_setup=wall,
        train_tok_s=e.tokens_per_s,
        val_loss_before=r.val_loss_before, val_loss=e.val_loss, train_loss=e.train_loss,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )  # fmt: skip


TORCH_WORKER = r"""
import json, resource, sys, time
import torch, torch.nn.functional as F
from transformers import AutoModelForCausalLM
from pathlib import Path
cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
p = Path(cfg["model"])
m = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).train()
m.model.embed_tokens.weight.requires_grad_(False)  # as llama.cpp: token_embd is not trained
opt = torch.optim.AdamW([q for q in m.parameters() if q.requires_grad], lr=cfg["lr"], weight_decay=0.0)
wins = torch.tensor(cfg["windows"])
n_train = cfg["n_train"]
t0 = time.perf_counter()
losses = []
for w in wins[:n_train]:
    opt.zero_grad()
    loss = F.cross_entropy(m(w[None, :-1]).logits[0], w[1:])
    loss.backward()
    opt.step()
    losses.append(loss.item())
t_train = time.perf_counter() - t0
with torch.no_grad():
    val = [F.cross_entropy(m(w[None, :-1]).logits[0], w[1:]).item() for w in wins[n_train:]]
wall = time.perf_counter() - t0
print(json.dumps(dict(steps=n_train, tokens=n_train * (wins.shape[1] - 1), seconds=wall,
      train_tok_s=n_train * (wins.shape[1] - 1) / t_train, train_loss=sum(losses) / len(losses),
      val_loss=sum(val) / max(1, len(val)),
      peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)))
"""


def run_llama_finetune(exe: Path, model: Path, data: Path, args, out: Path) -> dict:
    cmd = [
        str(exe), "-m", str(model), "-f", str(data), "-c", str(args.ctx),
        "-b", str(args.ctx), "-ub", str(args.ctx), "-t", str(args.threads), "-ngl", str(args.ngl),
        "-lr", str(LR), "-val-split", "0.1", "-epochs", "1", "-o", str(out),
    ]  # fmt: skip
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"llama-finetune failed:\n{p.stderr[-3000:]}")
    # the epoch: from llama_opt_epoch's progress bars (train: ... data=N/M loss=...; val: ...)
    train = re.findall(r"train: \[.*?data=(\d+)/(\d+) loss=([\d.]+).*?t=(\d+):(\d+):(\d+)", p.stderr)
    val = re.findall(r"val:   \[.*?data=(\d+)/(\d+) loss=([\d.]+).*?t=(\d+):(\d+):(\d+)", p.stderr)
    n_win = int(train[-1][0]) if train else 0  # data= counts windows (one ubatch of ctx tokens each)
    n_tok = n_win * args.ctx
    secs = lambda m: int(m[3]) * 3600 + int(m[4]) * 60 + int(m[5])  # noqa: E731
    epoch_s = (secs(train[-1]) if train else 0) + (secs(val[-1]) if val else 0)
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the first child of this process
    return dict(
        steps=n_win, tokens=n_tok, seconds=epoch_s or wall, wall_with_load=wall,
        train_loss=float(train[-1][2]) if train else None, val_loss=float(val[-1][2]) if val else None,
        peak_rss_mb=rss,
    )  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chars", type=int, default=12000)
    ap.add_argument("-ngl", type=int, default=0)
    ap.add_argument("--torch", default=None, help="python of a venv with torch + transformers + accelerate")
    ap.add_argument(
        "--runners", default="full,lora,qlora", help="llamabind rows: full, lora (F32 base), qlora (Q4_1 base)"
    )
    ap.add_argument("--worker", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.mode = args.worker
        print(json.dumps(worker_llamabind(args)))
        return 0

    import llamabind
    from llamabind import models, train

    exe = llamabind.tool_path("llama-finetune")
    if exe is None:
        print("llama-finetune not built: ./dev setup (LLAMABIND_BUILD_TOOLS=ON)", file=sys.stderr)
        return 1
    q4 = models.resolve("smollm2-135m-instruct")
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        f32 = tmpd / "smollm2-f32.gguf"
        train.to_f32(q4, f32)
        data = tmpd / "data.txt"
        doc = (ROOT / "vendor/llama.cpp/docs/build.md").read_text(encoding="utf-8")
        data.write_text((doc * (args.chars // len(doc) + 1))[: args.chars])  # repeated for large --chars

        def ours(mode, model):
            cmd = [sys.executable, __file__, "--worker", mode, "--model", str(model), "--data", str(data)]
            cmd += ["--threads", str(args.threads), "--ctx", str(args.ctx), "-ngl", str(args.ngl)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(p.stderr[-3000:])
            return json.loads(p.stdout.strip().splitlines()[-1])

        rows["llama-finetune (full)"] = run_llama_finetune(exe, f32, data, args, tmpd / "out.gguf")  # first child
        runners = args.runners.split(",")
        if "full" in runners:
            rows["llamabind full"] = ours("full", f32)
        if "lora" in runners:
            rows["llamabind LoRA r8 (F32 base)"] = ours("lora", f32)
        if "qlora" in runners:
            rows["llamabind QLoRA r8 (Q4_1 base)"] = ours("lora", q4)
        if args.torch:
            with llamabind.Model(f32, vocab_only=True) as v:
                win = train.windows(v.tokenize(data.read_text(encoding="utf-8"), add_special=True), args.ctx)
            n_train = int(len(win) * 0.9)
            cfg = dict(model=str(f32), threads=args.threads, lr=LR, windows=win.tolist(), n_train=n_train)
            p = subprocess.run([args.torch, "-c", TORCH_WORKER, json.dumps(cfg)], capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(p.stderr[-3000:])
            rows["PyTorch CPU full"] = json.loads(p.stdout.strip().splitlines()[-1])
    ref = rows["llama-finetune (full)"]
    print(f"\nSmolLM2-135M, ctx {args.ctx}, {args.threads} threads, -ngl {args.ngl}, 1 epoch, AdamW")
    print(f"| {'runner':32s} | steps | tok/s (epoch) | vs llama-finetune | train tok/s | peak RSS MiB | val loss |")
    print(f"|{'-' * 34}|-------|---------------|-------------------|-------------|--------------|----------|")
    for name, r in rows.items():
        tps = r["tokens"] / r["seconds"]
        ratio = tps / (ref["tokens"] / ref["seconds"]) if "full" in name or "finetune" in name else float("nan")
        ttps = r.get("train_tok_s", float("nan"))
        vl = r.get("val_loss")
        print(
            f"| {name:32s} | {r['steps']:5d} | {tps:13.1f} | {ratio:17.3f} | {ttps:11.1f} | "
            f"{r['peak_rss_mb']:12.0f} | {vl if vl is None else round(vl, 4)!s:>8} |"
        )
    out = {
        "host": socket.gethostname(), "platform": platform.platform(), "date": datetime.date.today().isoformat(),
        "args": vars(args), "build": llamabind.build_info(), "rows": rows,
    }  # fmt: skip
    res = HERE / "results" / f"train-{socket.gethostname()}-{datetime.date.today().isoformat()}.json"
    res.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {res}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
