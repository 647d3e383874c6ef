#!/usr/bin/env python3
"""Fine-tuning throughput and peak memory: llamabind (full, LoRA over F32, over F16/BF16, QLoRA over
the quantized GGUF), upstream's llama-finetune from the same tree, and PyTorch (transformers'
LlamaForCausalLM from the same F32 GGUF; f32, tf32 and bf16 autocast; full and peft LoRA in f32 or tf32) on the CPU
or the GPU, in one run, on the same windows of the same text, for every --ctx x --batch.

    python bench/train.py [--threads 2] [--ctx 256[,2048]] [--chars 12000] [-ngl 0] [--batch 1,4]
        [--model smollm2-135m-instruct | --size 1b] [--runners full,lora,lora-f16,lora-bf16,qlora,finetune]
        [--torch PYTHON] [--torch-device cpu|cuda] [--torch-runs f32,tf32,bf16,lora,lora-tf32,lora-bf16,qlora-nf4]
        [--torch-init gguf|random] [--lora-rank 8] [--lora-targets qv|all] [--loss-chunk-tokens N]
        [--steps N] [--peak TFLOPS] [--out FILE.json]

Data: the pinned tree's docs/build.md (its first --chars characters, repeated for more), cut as
upstream's common_opt_dataset_init does: windows of ctx + 1 tokens every ctx / 2, the last 10% held
out. Full fine-tunes take AdamW lr 1e-5, LoRA r8 (attn_q, attn_v; alpha 16) lr 1e-4, windows in
order. The model: the default SmolLM2-135M (Q4_1, token_embd Q8_0, tied output: its QLoRA base as
shipped; the F32 copy for full and LoRA) or, with --size, a random-weight llama of that shape
(bench/make_model.py: Q4_0 for QLoRA, its F32 copy for the rest; lora-f16/-bf16: LoRA over F16/BF16
copies). A batch runs as one graph (its windows as sequences); full fine-tunes train every weight,
token_embd included, on both sides.

Every runner is its own process. "train tok/s": the training tokens of one optimizer step over the
median time of the steps after the first (the first's graph allocation and warm-up left out, and so
is one slower step: on CUDA, ggml captures its CUDA graph in the second), the same for every runner;
the mean over those steps stays in the JSON (train_tok_s_mean); --steps steps per runner (default:
one pass over the train windows; the JSON keeps every step's time). Peak memory:
RSS (ru_maxrss) and, on a GPU, the process's GPU memory as nvidia-smi reports it (the CUDA context
included, for every runner alike), sampled every 0.2 s. TFLOP/s: per token 6 N + 12 L T d for a full
fine-tune, 4 N + 8 L T d for LoRA (no weight gradients; the adapters' own products left out), N the
parameters in matrix products, L layers, T ctx, d n_embd; MFU against --peak (default the H100 SXM's
dense BF16, 989.5: the products' precision on a GPU by default and under PyTorch's bf16 autocast; 494.7 for
its TF32; the CPU rows' MFU is meaningless).
PyTorch (bench/_torch_train_worker.py): --torch-init gguf (default) loads the F32 GGUF through transformers (the
same weights as ours); --torch-init random draws the GGUF's shape with transformers' own init on the GPU, bf16
weights for the bf16 runs (torch_dtype=bfloat16, as users load an 8B; the val loss then means nothing): what the 8B
and 70B shapes need. qlora-nf4: peft LoRA over bitsandbytes' NF4 weights with double quantization and bf16
compute (the QLoRA paper's BitsAndBytesConfig), under bf16 autocast.
llama-finetune's row (full fine-tune, its whole-second timings: give it a long text on a GPU) is
the native reference. Prints a table and writes bench/results/train-<host>-<date>.json (--out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LR_FULL, LR_LORA, RANK = 1e-5, 1e-4, 8


def worker_llamabind(args) -> dict:
    import llamabind
    from llamabind import train

    text = Path(args.data).read_text(encoding="utf-8")
    lora = args.mode == "lora"
    times: list[float] = []
    kw = dict(n_threads=args.threads, n_gpu_layers=args.ngl, repack=False)
    with llamabind.Model(args.model, use_mmap=lora, **kw) as m:
        flash = {"auto": None, "on": True, "off": False}[args.worker_flash]
        r = train.finetune(
            m, text, ctx_size=args.ctx, lr=LR_LORA if lora else LR_FULL, val_split=0.1, progress=False,
            n_threads=args.threads, lora_rank=args.lora_rank if lora else None, shuffle=False, batch_size=args.batch,
            iters=args.steps, on_step=lambda step, loss: times.append(time.perf_counter()),
            precision=args.worker_precision, flash_attn=flash, gradient_checkpointing=args.worker_gc,
            lora_targets=lora_targets(args.lora_targets), loss_chunk_tokens=args.loss_chunk_tokens,
        )  # fmt: skip
    e = r.epochs[-1]
    tok_per_step = args.batch * args.ctx
    return dict(
        steps=r.steps, batch=args.batch, train_tok_s=_steady(times, tok_per_step), step_times=_diffs(times),
        val_loss_before=r.val_loss_before, val_loss=e.val_loss, train_loss=e.train_loss,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )  # fmt: skip


def lora_targets(spec: str) -> tuple[str, ...]:
    """--lora-targets: "qv" (attn_q, attn_v), "all" (every linear layer of a block: train.LORA_TARGETS) or GGUF
    names joined by commas."""
    from llamabind import train

    return {"qv": ("attn_q", "attn_v"), "all": train.LORA_TARGETS}.get(spec) or tuple(spec.split(","))


def base_models(size: str | None, model: str, tmpd: Path, f32: bool = True) -> tuple[Path, Path]:
    """(the quantized GGUF, its F32 copy in tmpd): a random-weight llama of bench/make_model.py's ``size`` shape
    in Q4_0, or the named or given ``model``. ``f32=False``: no copy is written (an 8B's is 32 GB, a 70B's would
    not fit the disk) and the quantized GGUF's path is returned twice."""
    from llamabind import models, train

    if size:
        quant = tmpd / f"llama-{size}-q4_0.gguf"
        subprocess.run([sys.executable, str(HERE / "make_model.py"), "--size", size, "--type", "q4_0",
                        "-o", str(quant)], check=True)  # fmt: skip
    else:
        quant = Path(models.resolve(model))
    if not f32:
        return quant, quant
    copy = tmpd / "f32.gguf"
    train.to_f32(quant, copy)
    return quant, copy


def flops_per_token(path: Path, ctx: int, lora: bool) -> float:
    """6 N + 12 L T d (full) or 4 N + 8 L T d (LoRA): N the parameters in matrix products (the
    output matrix, tied or not; not token_embd's lookup)."""
    import gguf

    shapes = {t.name: [int(n) for n in t.shape] for t in gguf.GGUFReader(path).tensors}
    n_layer = len({n.split(".")[1] for n in shapes if n.startswith("blk.")})
    d, n_vocab = shapes["token_embd.weight"][:2]
    n = sum(s[0] * s[1] for name, s in shapes.items() if len(s) == 2 and name != "token_embd.weight")
    n += d * n_vocab if "output.weight" not in shapes else 0
    return (4 * n + 8 * n_layer * ctx * d) if lora else (6 * n + 12 * n_layer * ctx * d)


def _diffs(times: list[float]) -> list[float]:
    return [round(b - a, 5) for a, b in zip(times, times[1:])]


def _steady(times: list[float], tok_per_step: int) -> float:
    """Tokens/s over the steps after the first (times: the end of each step)."""
    if len(times) < 2:
        return float("nan")
    return (len(times) - 1) * tok_per_step / (times[-1] - times[0])


TORCH_WORKER = HERE / "_torch_train_worker.py"  # the PyTorch runner: one process, one row
# GGUF tensor names -> transformers module names, for the LoRA targets
HF_TARGETS = dict(attn_q="q_proj", attn_k="k_proj", attn_v="v_proj", attn_output="o_proj", ffn_gate="gate_proj",
                  ffn_up="up_proj", ffn_down="down_proj")  # fmt: skip


class GpuPeak:
    """The largest GPU memory nvidia-smi reports for a process, sampled every 0.2 s."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.peak_mb = proc, None
        self.thread = threading.Thread(target=self._poll, daemon=True)
        if shutil.which("nvidia-smi"):
            self.thread.start()

    def _poll(self) -> None:
        q = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
        while self.proc.poll() is None:
            try:
                out = subprocess.run(q, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                return
            for line in out.splitlines():
                pid, _, mb = line.partition(",")
                if pid.strip() == str(self.proc.pid) and mb.strip().isdigit():
                    self.peak_mb = max(self.peak_mb or 0, int(mb))
            time.sleep(0.2)


def run_process(cmd: list[str], timeout: float = 3600) -> tuple[str, str, float | None]:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    gpu = GpuPeak(p)
    out, err = p.communicate(timeout=timeout)
    if p.returncode != 0:
        # an abort's own message comes before its backtrace: keep the lines that say what failed, then the tail
        said = [ln for ln in err.splitlines() if re.search(r"error|assert|abort|out of memory|failed", ln, re.I)]
        raise RuntimeError(f"{cmd[:3]} failed:\n" + "\n".join(said[-12:]) + f"\n...\n{err[-1500:]}")
    return out, err, gpu.peak_mb


def run_llama_finetune(exe: Path, model: Path, data: Path, args, out: Path) -> dict:
    cmd = [
        str(exe), "-m", str(model), "-f", str(data), "-c", str(args.ctx),
        "-b", str(args.ctx), "-ub", str(args.ctx), "-t", str(args.threads), "-ngl", str(args.ngl),
        "-lr", str(LR_FULL), "-val-split", "0.1", "-epochs", "1", "-o", str(out),
    ]  # fmt: skip
    _, err, gpu_mb = run_process(cmd)
    # the epoch's training part, from llama_opt_epoch's progress bar (train: ... data=N/M loss=... t=H:M:S)
    train = re.findall(r"train: \[.*?data=(\d+)/(\d+) loss=([\d.]+).*?t=(\d+):(\d+):(\d+)", err)
    val = re.findall(r"val:   \[.*?data=(\d+)/(\d+) loss=([\d.]+)", err)
    n_win = int(train[-1][0]) if train else 0
    secs = int(train[-1][3]) * 3600 + int(train[-1][4]) * 60 + int(train[-1][5]) if train else 0
    return dict(
        steps=n_win, batch=1, train_tok_s=n_win * args.ctx / secs if secs else float("nan"),
        train_loss=float(train[-1][2]) if train else None, val_loss=float(val[-1][2]) if val else None,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, peak_gpu_mb=gpu_mb,
    )  # fmt: skip


def torch_job(args, run: str, f32: Path, win, n_train: int, batch: int, gc: bool) -> dict:
    """The PyTorch runner's job (bench/_torch_train_worker.py) for a --torch-runs entry: f32, tf32, bf16 (full),
    lora, lora-tf32, lora-bf16 (peft), qlora-nf4 (peft over bitsandbytes NF4, bf16 compute, bf16 autocast)."""
    lora = run.startswith(("lora", "qlora"))
    precision = "bf16" if run == "qlora-nf4" else (run[5:] or "f32") if lora else run
    random_bf16 = args.torch_init == "random" and precision == "bf16"
    weights = "nf4" if run == "qlora-nf4" else "bf16" if random_bf16 else "f32"
    return dict(
        model=str(f32), init=args.torch_init, weights=weights, threads=args.threads, lr=LR_LORA if lora else LR_FULL,
        lora=lora, rank=args.lora_rank, targets=[HF_TARGETS[t] for t in lora_targets(args.lora_targets)],
        windows=win.tolist(), n_train=n_train, batch=batch, steps=args.steps or -(-n_train // batch),
        device=args.torch_device, precision=precision, gc=gc, max_val=2 if args.torch_init == "random" else 1 << 30,
    )  # fmt: skip


def torch_row_name(args, run: str, cfg: dict) -> str:
    rk = f"r{args.lora_rank}" + ("" if args.lora_targets == "qv" else f" {args.lora_targets}")
    what = {"nf4": "NF4 base", "bf16": "bf16 weights", "f32": ""}[cfg["weights"]]
    prec = ", ".join(x for x in (cfg["precision"], what) if x)
    return f"LoRA {rk} (peft, {prec})" if cfg["lora"] else f"full {run}" + (f" ({what})" if what else "")


def median_tok_s(row: dict) -> float:
    """Tokens/s of a row's median step (step_times in seconds, batch windows of ctx tokens each)."""
    return row["batch"] * row["ctx"] / statistics.median(row["step_times"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", default="256", help="tokens per window, comma-separated for several")
    ap.add_argument("--chars", type=int, default=12000)
    ap.add_argument("-ngl", type=int, default=0)
    ap.add_argument("--batch", default="1,4", help="windows per step, comma-separated")
    ap.add_argument("--peak", type=float, default=989.5, help="dense peak TFLOP/s for MFU (H100 SXM BF16)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per runner (default: one epoch)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model name or a quantized GGUF")
    ap.add_argument("--size", default=None, help="a random-weight llama of this bench/make_model.py shape instead")
    ap.add_argument(
        "--runners",
        default="full,lora,qlora,finetune",
        help="full, lora, lora-f16, lora-bf16, qlora (the defaults: precision bf16, flash attention on a GPU), "
        "full-f32, lora-f32, qlora-f32 (F32 products, composed attention), full-gc, lora-gc, qlora-gc (recomputed "
        "activations: gradient checkpointing), finetune",
    )
    ap.add_argument("--torch", default=None, help="python with torch + transformers (+ peft for the LoRA row)")
    ap.add_argument("--torch-device", default="cpu")
    ap.add_argument(
        "--torch-runs",
        default="f32",
        help="f32, tf32, bf16 (full fine-tunes; bf16: autocast, SDPA's flash attention), lora (peft, f32), "
        "lora-tf32, lora-bf16 (peft under bf16 autocast), qlora-nf4 (peft over bitsandbytes NF4); a -gc suffix "
        "(bf16-gc, lora-bf16-gc): transformers' "
        "gradient checkpointing",
    )
    ap.add_argument(
        "--torch-init",
        choices=["gguf", "random"],
        default="gguf",
        help="PyTorch's weights: the F32 "
        "GGUF's (transformers loads it) or the shape's, drawn by transformers' init (8B/70B shapes)",
    )
    ap.add_argument("--lora-rank", type=int, default=RANK, help="LoRA rank, both sides (alpha 2 x rank)")
    ap.add_argument("--lora-targets", default="qv", help="qv, all (every linear layer) or GGUF names, both sides")
    ap.add_argument("--loss-chunk-tokens", type=int, default=None, help="llamabind's chunked cross-entropy")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", choices=["full", "lora"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-ctx", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--worker-batch", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-precision", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--worker-flash", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--worker-gc", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.mode, args.ctx, args.batch = args.worker, args.worker_ctx, args.worker_batch
        print(json.dumps(worker_llamabind(args)))
        return 0
    ctxs = [int(c) for c in str(args.ctx).split(",")]
    batches = sorted({int(b) for b in str(args.batch).split(",")})

    import llamabind
    from llamabind import train
    from llamabind.model import quantize

    rows: dict[str, dict] = {}
    runners = args.runners.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        plain = {r.removesuffix("-gc").removesuffix("-f32") for r in runners}
        need_f32 = bool(plain & {"full", "lora", "lora-f16", "lora-bf16", "finetune"})
        quant, f32 = base_models(args.size, args.model, tmpd, need_f32 or (args.torch and args.torch_init == "gguf"))
        half = {}
        for r, ftype in (("lora-f16", "F16"), ("lora-bf16", "BF16")):
            if r in runners:
                half[r] = tmpd / f"{ftype.lower()}.gguf"
                quantize(f32, half[r], ftype)
        with llamabind.Model(quant, vocab_only=True) as v:
            qtype = next(t for name, t, _ in v.tensor_info() if name == "blk.0.attn_q.weight").upper()
            desc = f"{quant.name} ({v.n_params / 1e6:.0f} M parameters, attn_q {qtype})"
        data = tmpd / "data.txt"
        doc = (ROOT / "vendor/llama.cpp/docs/build.md").read_text(encoding="utf-8")
        data.write_text((doc * (args.chars // len(doc) + 1))[: args.chars])

        def ours(mode: str, model: Path, ctx: int, batch: int, f32: bool = False, gc: bool = False) -> dict:
            cmd = [sys.executable, __file__, "--worker", mode, "--model", str(model), "--data", str(data)]
            if f32:  # the F32 products and composed attention (before issue 56), for the same run's ratio
                cmd += ["--worker-precision", "f32", "--worker-flash", "off"]
            cmd += ["--worker-gc"] if gc else []
            cmd += ["--threads", str(args.threads), "--worker-ctx", str(ctx), "-ngl", str(args.ngl)]
            cmd += ["--lora-rank", str(args.lora_rank), "--lora-targets", args.lora_targets]
            cmd += ["--loss-chunk-tokens", str(args.loss_chunk_tokens)] if args.loss_chunk_tokens else []
            cmd += ["--worker-batch", str(batch)] + (["--steps", str(args.steps)] if args.steps else [])
            try:
                out, _, gpu_mb = run_process(cmd)
            except RuntimeError as err:
                return dict(error=str(err)[:1200], batch=batch, ctx=ctx)
            return {**json.loads(out.strip().splitlines()[-1]), "peak_gpu_mb": gpu_mb, "ctx": ctx}

        def done(name: str, row: dict) -> None:  # one line a row as it ends: a run cut short keeps its rows
            tps = median_tok_s(row) if row.get("step_times") else row.get("train_tok_s")
            print(f"row done: {name}: {tps or row.get('error', '')} tok/s, {row.get('peak_gpu_mb')} GPU MiB",
                  file=sys.stderr, flush=True)  # fmt: skip

        for ctx in ctxs:
            fpt = {lora: flops_per_token(f32, ctx, lora) for lora in (False, True)}
            args.ctx = ctx
            if "finetune" in runners:
                exe = llamabind.tool_path("llama-finetune")
                if exe is None:
                    print("llama-finetune not built: ./dev setup (LLAMABIND_BUILD_TOOLS=ON)", file=sys.stderr)
                    return 1
                name = f"llama-finetune full, ctx {ctx}, batch 1"
                rows[name] = {**run_llama_finetune(exe, f32, data, args, tmpd / "out.gguf"), "fpt": fpt[False]}
            for b in batches:
                rk = f"r{args.lora_rank}" + ("" if args.lora_targets == "qv" else f" {args.lora_targets}")
                base = {"full": ("full", f32, "full"), "lora": ("lora", f32, f"LoRA {rk} (F32 base)")}
                base["lora-f16"] = ("lora", half.get("lora-f16"), f"LoRA {rk} (F16 base)")
                base["lora-bf16"] = ("lora", half.get("lora-bf16"), f"LoRA {rk} (BF16 base)")
                base["qlora"] = ("lora", quant, f"QLoRA {rk} ({qtype} base)")
                for r in runners:
                    gc_run = r.endswith("-gc")  # full-gc, lora-gc, qlora-gc: recomputed activations
                    r = r.removesuffix("-gc")
                    f32_run = r.endswith("-f32")  # full-f32, lora-f32, qlora-f32: F32 products, no flash attention
                    if r.removesuffix("-f32") in base:
                        mode, path, what = base[r.removesuffix("-f32")]
                        what += " f32, composed attention" if f32_run else ""
                        what += " recomputed activations" if gc_run else ""
                        name = f"llamabind {what}, ctx {ctx}, batch {b}"
                        rows[name] = {**ours(mode, path, ctx, b, f32_run, gc_run), "fpt": fpt[mode == "lora"]}
                        done(name, rows[name])
            if args.torch:
                with llamabind.Model(f32, vocab_only=True) as v:
                    win = train.windows(v.tokenize(data.read_text(encoding="utf-8"), add_special=True), ctx)
                n_train = int(len(win) * 0.9)
                for run_gc in args.torch_runs.split(","):
                    run = run_gc.removesuffix("-gc")
                    gc = run_gc != run  # bf16-gc, lora-bf16-gc: transformers' gradient checkpointing
                    for b in batches:
                        cfg = torch_job(args, run, f32, win, n_train, b, gc)
                        job = tmpd / "torch-job.json"  # the windows: too long for a command line
                        job.write_text(json.dumps(cfg))
                        name = f"PyTorch {args.torch_device} {torch_row_name(args, run, cfg)}"
                        name += (" gradient checkpointing" if gc else "") + f", ctx {ctx}, batch {b}"
                        lora = cfg["lora"]
                        try:
                            out, _, gpu_mb = run_process([args.torch, str(TORCH_WORKER), str(job)])
                            rows[name] = {**json.loads(out.strip().splitlines()[-1]), "peak_gpu_mb": gpu_mb}
                        except RuntimeError as err:
                            oom = "out of memory" in str(err).lower()
                            rows[name] = dict(error="out of memory" if oom else str(err)[:1200], batch=b)
                        rows[name].update(ctx=ctx, fpt=fpt[lora])
                        done(name, rows[name])

    print(f"\n{desc}, {args.threads} threads, -ngl {args.ngl}, AdamW (full lr {LR_FULL}, LoRA {LR_LORA})")
    print(f"| {'runner':58s} | steps | train tok/s | TFLOP/s | MFU | peak RSS MiB | peak GPU MiB | val loss |")
    print(f"|{'-' * 60}|-------|-------------|---------|-----|--------------|--------------|----------|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name:58s} | {r['error'][:60]} |")
            continue
        if r.get("step_times"):  # the median step, every runner alike (llama-finetune's row has none)
            r["train_tok_s_mean"] = r["train_tok_s"]
            r["train_tok_s"] = median_tok_s(r)
        vl, gm = r.get("val_loss"), r.get("peak_gpu_mb")
        r["tflops"] = r["fpt"] * r["train_tok_s"] / 1e12
        r["mfu"] = r["tflops"] / args.peak
        print(
            f"| {name:58s} | {r['steps']:5d} | {r['train_tok_s']:11.1f} | {r['tflops']:7.1f} | "
            f"{100 * r['mfu']:4.1f}% | "
            f"{r['peak_rss_mb']:12.0f} | {'-' if gm is None else gm:>12} | {'-' if vl is None else round(vl, 4)!s:>8} |"
        )
    result = {
        "host": socket.gethostname(), "platform": platform.platform(), "date": datetime.date.today().isoformat(),
        "model": desc, "args": vars(args), "build": llamabind.build_info(), "rows": rows,
    }  # fmt: skip
    out_path = Path(args.out) if args.out else HERE / "results" / f"train-{socket.gethostname()}-{result['date']}.json"
    out_path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
