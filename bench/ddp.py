#!/usr/bin/env python3
"""Data-parallel fine-tuning throughput (issue 87): llamabind's finetune launched by torchrun on 1, 2, 4, 8
processes (one GPU each, the gradients averaged by torch.distributed's all-reduce before each step: NCCL on GPUs,
gloo on the CPU) beside PyTorch DDP (transformers' LlamaForCausalLM from the same F32 GGUF, bf16 autocast, SDPA,
torch.nn.parallel.DistributedDataParallel, AdamW) on the same windows, for each --nproc, in one run.

    python bench/ddp.py [--size 1b | --model GGUF] [--ctx 2048] [--batch 4] [--nproc 1,2,4,8] [--steps 8]
        [--runners full,lora] [--bucket-cap-mb 0,128] [--torch PYTHON] [--torch-path SITE] [--out FILE.json]

--batch windows per process and step (TRL's per_device_train_batch_size): a step takes batch x N windows, random
token ids (throughput only). tokens/s: the global batch's tokens over the median step after the first two, from rank
0's clock; scaling efficiency: tokens/s at N over N x tokens/s at 1. Full fine-tunes train every weight (AdamW lr
1e-5), LoRA r8 on q/v (lr 1e-4) over the F32 weights on both sides. Each (runner, N) is one torchrun launch of this
file in worker mode. --torch-path: a site-packages with torch for llamabind's processes where its Python has none
(the CPU dry run: the reference venv's). --bucket-cap-mb: llamabind's rows for each TrainingArgs.ddp_bucket_cap_mb
(0: the all-reduce after the backward pass; > 0: buckets all-reduced during it, patch 0104), PyTorch's once (DDP's
default buckets). Prints a table and writes bench/results/ddp-<host>-<date>.json (--out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train import base_models, flops_per_token  # noqa: E402

LR_FULL, LR_LORA, RANK = 1e-5, 1e-4, 8

TORCH_DDP_WORKER = r"""
import json, os, sys, time
import torch, torch.distributed as dist, torch.nn.functional as F
from transformers import AutoModelForCausalLM
from pathlib import Path
cfg = json.loads(Path(sys.argv[1]).read_text())
rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
gpu = torch.cuda.is_available()
dist.init_process_group("nccl" if gpu else "gloo")
dev = torch.device(f"cuda:{local}" if gpu else "cpu")
p = Path(cfg["model"])
m = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32,
                                         attn_implementation="sdpa").to(dev).train()
if cfg["lora"]:
    from peft import LoraConfig, get_peft_model
    m = get_peft_model(m, LoraConfig(r=cfg["rank"], lora_alpha=2 * cfg["rank"], lora_dropout=0.0,
                                     target_modules=["q_proj", "v_proj"]))
ddp = torch.nn.parallel.DistributedDataParallel(m, device_ids=[local] if gpu else None)
opt = torch.optim.AdamW([q for q in ddp.parameters() if q.requires_grad], lr=cfg["lr"], weight_decay=0.0)
wins = torch.tensor(cfg["windows"], device=dev)
B, steps = cfg["batch"], cfg["steps"]
times = []
for s in range(steps):
    w = wins[(s * B * world + torch.arange(B * world, device=dev)) % len(wins)][rank::world]
    opt.zero_grad(set_to_none=True)
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=gpu):
        logits = ddp(w[:, :-1]).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    loss.item()  # synchronizes
    times.append(time.perf_counter())
if rank == 0:
    Path(cfg["out"]).write_text(json.dumps(dict(times=times, peak_alloc_mb=torch.cuda.max_memory_allocated() / 2**20
                                                if gpu else None)))
dist.destroy_process_group()
"""


def worker_llamabind(job_file: str) -> None:
    """One rank of llamabind's run (torchrun's environment): finetune over the job's windows, rank 0 writes the
    step times."""
    import numpy as np

    import llamabind
    from llamabind import train

    cfg = json.loads(Path(job_file).read_text())
    local, rank = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("RANK", "0"))
    kw = dict(n_gpu_layers=cfg["ngl"], n_threads=cfg["threads"], repack=False)
    if cfg["ngl"]:
        kw.update(split_mode="none", main_gpu=local)
    times: list[float] = []
    lora = cfg["lora"]
    tokens = np.asarray(cfg["windows"], np.int32)
    examples = [train.Example(w, np.ones(len(w), bool)) for w in tokens]  # a window each
    with llamabind.Model(cfg["model"], use_mmap=lora, **kw) as m:
        train.finetune(
            m, examples, ctx_size=cfg["ctx"], batch_size=cfg["batch"], iters=cfg["steps"], val_split=0.0,
            lr=LR_LORA if lora else LR_FULL, lora_rank=RANK if lora else None, shuffle=False, progress=False,
            n_threads=cfg["threads"], on_step=lambda step, loss: times.append(time.perf_counter()),
            ddp_bucket_cap_mb=cfg["bucket_cap_mb"],
        )  # fmt: skip
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(dict(times=times)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(python: str, nproc: int, argv: list[str], env: dict) -> None:
    cmd = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(_port()), *argv]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        err = [ln for ln in p.stderr.splitlines() if not ln.startswith(("llama", "load", "print_info", "ggml"))]
        raise RuntimeError(f"{' '.join(cmd[:8])} failed:\n" + "\n".join(err[-60:]))


def tok_s(times: list[float], tok_per_step: int) -> float:
    """Tokens a step over the median step time after the first two (graph allocation, CUDA graph capture)."""
    d = [b - a for a, b in zip(times, times[1:])][1:]
    return tok_per_step / statistics.median(d) if d else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, help="a random-weight llama of this bench/make_model.py shape")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model name or a quantized GGUF (no --size)")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4, help="windows per process and step")
    ap.add_argument("--nproc", default="1,2", help="process counts, comma-separated")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--runners", default="full", help="full, lora (comma-separated)")
    ap.add_argument("--bucket-cap-mb", default="128", help="llamabind's ddp_bucket_cap_mb values, comma-separated")
    ap.add_argument("-ngl", type=int, default=None, help="layers on the GPU (default: all where there is one)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    ap.add_argument("--peak", type=float, default=989.5, help="dense peak TFLOP/s per GPU for MFU (H100 SXM BF16)")
    ap.add_argument("--torch", default=None, help="python with torch + transformers (+ peft for LoRA): PyTorch DDP")
    ap.add_argument("--torch-path", default=None, help="site-packages with torch for llamabind's processes")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_llamabind(args.worker)
        return 0
    import numpy as np

    from llamabind.build import devices

    gpus = sum(d.get("type") == "gpu" for d in devices())
    ngl = args.ngl if args.ngl is not None else (999 if gpus else 0)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.torch_path:
        env["PYTHONPATH"] = args.torch_path
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        _, f32 = base_models(args.size, args.model, tmpd)
        counts = [int(n) for n in args.nproc.split(",")]
        n_win = args.batch * max(counts) * 2
        windows = np.random.default_rng(0).integers(100, 30000, (n_win, args.ctx + 1)).tolist()
        for runner in args.runners.split(","):
            lora = runner == "lora"
            for n, cap in ((n, float(c)) for n in counts for c in args.bucket_cap_mb.split(",")):
                row = dict(runner=runner, nproc=n, ctx=args.ctx, batch=args.batch, bucket_cap_mb=cap)
                job = dict(model=str(f32), ctx=args.ctx, batch=args.batch, steps=args.steps, lora=lora, rank=RANK,
                           lr=LR_LORA if lora else LR_FULL, windows=windows, ngl=ngl, threads=args.threads,
                           out=str(tmpd / "result.json"), bucket_cap_mb=cap)  # fmt: skip
                (tmpd / "job.json").write_text(json.dumps(job))
                tok_step = args.batch * n * args.ctx
                launch(sys.executable, n, [str(Path(__file__).resolve()), "--worker", str(tmpd / "job.json")], env)
                row["llamabind_tok_s"] = tok_s(json.loads((tmpd / "result.json").read_text())["times"], tok_step)
                if args.torch and cap == float(args.bucket_cap_mb.split(",")[0]):
                    (tmpd / "worker.py").write_text(TORCH_DDP_WORKER)
                    try:  # e.g. no peft for the LoRA row: the row stays, without PyTorch's number
                        launch(args.torch, n, [str(tmpd / "worker.py"), str(tmpd / "job.json")], dict(os.environ))
                        row["torch_tok_s"] = tok_s(json.loads((tmpd / "result.json").read_text())["times"], tok_step)
                    except RuntimeError as e:
                        row["torch_error"] = str(e).splitlines()[-1][:300]
                row["mfu"] = row["llamabind_tok_s"] * flops_per_token(f32, args.ctx, lora) / (n * args.peak * 1e12)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    one = {(r["runner"], r["bucket_cap_mb"]): r for r in rows if r["nproc"] == 1}
    print(f"{'runner':8} {'N':>3} {'buckets MiB':>11} {'llamabind tok/s':>16} {'scaling':>8} {'PyTorch DDP':>12} "
          f"{'ratio':>6} {'MFU':>6}")  # fmt: skip
    for r in rows:
        base = one.get((r["runner"], r["bucket_cap_mb"]))
        eff = r["llamabind_tok_s"] / (r["nproc"] * base["llamabind_tok_s"]) if base else float("nan")
        t = r.get("torch_tok_s", float("nan"))
        print(f"{r['runner']:8} {r['nproc']:>3} {r['bucket_cap_mb']:>11g} {r['llamabind_tok_s']:>16,.0f} {eff:>8.2f} "
              f"{t:>12,.0f} {r['llamabind_tok_s'] / t:>6.2f} {r['mfu']:>6.1%}")  # fmt: skip
        r["scaling"] = eff
    out = Path(args.out or HERE / "results" / f"ddp-{socket.gethostname()}-{datetime.date.today()}.json")
    out.write_text(json.dumps(dict(args=vars(args), gpus=gpus, rows=rows), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
