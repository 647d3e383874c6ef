#!/usr/bin/env python3
"""Where a fine-tuning step's time goes (issue 42): graph build, allocation, inputs, compute, and the
compute split into forward, backward and optimizer ops, for the pin's way of running a batch (one
window per graph, the graphs rebuilt for every window, token_embd frozen: "pin") beside this tree's
(the batch's windows as sequences of one graph, graphs kept across steps, token_embd trained: "now"),
and LoRA (--lora-rank, default 8, on --lora-targets: qv, attn_q/attn_v, or all, every linear layer of a block) over
the F32 model ("lora") or over its quantized original ("qlora"; with --qmodel alone, no F32 copy: the 8B and 70B
shapes, issue 88).

    python bench/train_profile.py [--size 1b | --model GGUF] [--configs 256x8,2048x1] [-ngl 99]
        [--qmodel GGUF] [--steps 6] [--profile-steps 2] [--modes pin,now,lora,qlora] [--threads 8] [--out FILE.json]
        [--lora-rank 8] [--lora-targets qv|all]

Each (mode, ctx x batch) runs in its own process on random windows (a random-weight llama of
bench/make_model.py's shape, F32, or an F32 GGUF given with --model), full fine-tune, AdamW lr 1e-5.
"step ms" is the median of the timed steps after a warm-up step; the build/alloc/inputs/compute
columns are llama_opt_get_stats per optimizer step (patch 0032); the phases and ops come from
Trainer(profile=True) runs, where the scheduler computes the nodes one at a time and waits for each
(times include a launch and a synchronization per node; their sum is printed beside the step time).
TFLOP/s: (6 N + 12 L T d) per token (N: the parameters in matrix products, L layers, T ctx, d n_embd:
the forward and backward of the weights and of the attention scores), over the step time; MFU
against --peak (H100 SXM dense TF32: 494.7 TFLOP/s). Prints tables and writes JSON.
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
from train import GpuPeak, lora_targets  # noqa: E402 (bench/train.py: nvidia-smi's peak of a process, --lora-targets)


def flops_per_token(path: str, ctx: int) -> tuple[float, dict]:
    """(6 N + 12 L T d, shape facts) of a llama GGUF: N the parameters that enter matrix products
    (the output matrix, tied or not; not token_embd's lookup)."""
    import gguf

    r = gguf.GGUFReader(path)
    shapes = {t.name: [int(n) for n in t.shape] for t in r.tensors}
    n_layer = len({n.split(".")[1] for n in shapes if n.startswith("blk.")})
    d = shapes["token_embd.weight"][0]
    n = sum(a * b for name, (a, *rest) in shapes.items() for b in rest[:1] if name != "token_embd.weight")
    if "output.weight" not in shapes:
        n += d * shapes["token_embd.weight"][1]  # tied: the output product reads token_embd
    return 6 * n + 12 * n_layer * ctx * d, dict(n_matmul_params=n, n_layer=n_layer, n_embd=d)


def worker(args) -> dict:
    import numpy as np

    import llamabind
    from llamabind import train

    ctx, batch = args.ctx, args.batch
    pin = args.mode == "pin"
    lora = args.mode in ("lora", "qlora")
    # "pin", "now": F32 products, composed attention (this tree before issue 56); "fa": F32 products with
    # flash attention; "bf16", "lora", "qlora": the defaults (BF16 products, flash attention on a GPU)
    f32 = args.mode in ("pin", "now", "fa")
    flash = {"pin": False, "now": False, "fa": True}.get(args.mode)
    if pin:
        os.environ["LLAMA_GRAPH_REUSE_DISABLE"] = "1"  # read when the context is made: rebuild every eval
    rng = np.random.default_rng(0)
    out: dict = dict(mode=args.mode, ctx=ctx, batch=batch)
    path = args.qmodel if args.mode == "qlora" else args.model
    kw_model = dict(use_mmap=lora, repack=not lora, n_gpu_layers=args.ngl, n_threads=args.threads)
    with llamabind.Model(path, **kw_model) as m:
        wins = rng.integers(3, m.n_vocab, size=(batch, ctx + 1), dtype=np.int32)
        kw = dict(ctx_size=ctx, batch_size=batch, grad_accum=batch if pin else 1, lr=1e-4 if lora else 1e-5,
                  train_embeddings=not pin, n_threads=args.threads, precision="f32" if f32 else "bf16",
                  flash_attn=flash)  # fmt: skip
        if lora:  # LoRA (bench/train.py's: alpha 2 x rank), over the F32 model or the quantized one
            adapter = Path(tempfile.mkdtemp()) / "lora.gguf"
            train.lora_init(m, adapter, rank=args.lora_rank, alpha=2.0 * args.lora_rank,
                            targets=lora_targets(args.lora_targets))  # fmt: skip
            kw.update(params="lora", adapter=m.load_lora(adapter), train_embeddings=False)
        with train.Trainer(m, **kw) as t:
            t.step(wins)  # warm-up: first allocation, cuBLAS handles
            s0 = t.stats()
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                t.step(wins)
                times.append(time.perf_counter() - t0)
            s1 = t.stats()
        n = args.steps
        per_step = {k: (s1[k] - s0[k]) / n for k in s1}
        out.update(step_ms=1e3 * statistics.median(times), step_ms_all=[round(1e3 * x, 3) for x in times],
                   per_step=per_step, memory=_memory(m, args, lora, flash is not False))  # fmt: skip
        if args.profile_steps:
            with train.Trainer(m, **kw, profile=True) as t:
                t.step(wins)
                t.profile()  # the warm-up step's times dropped
                t0 = time.perf_counter()
                for _ in range(args.profile_steps):
                    t.step(wins)
                out["profiled_step_ms"] = 1e3 * (time.perf_counter() - t0) / args.profile_steps
                rows = t.profile()
            for r in rows:
                r["ms"] /= args.profile_steps
                r["nodes"] //= args.profile_steps
            out["profile"] = rows
    return out


def _memory(m, args, lora: bool, flash: bool) -> dict:
    """MiB by tensor kind, from the shapes: weights (the model's tensors), the trained tensors' F32
    gradients and AdamW moments (m, v), and the attention matrices the composed attention keeps for
    the backward pass (its softmax, F32, batch x n_head x ctx^2 per layer; none with flash
    attention; KQ itself is not needed by the backward pass once its softmax is computed: the softmax
    output is what SOFT_MAX_BACK reads). The rest of the measured peak is the other activations, the
    graph's transient buffers and the CUDA context."""
    import gguf

    r = gguf.GGUFReader(args.model or args.qmodel)
    n_head = int(r.fields["llama.attention.head_count"].contents())
    n_layer = int(r.fields["llama.block_count"].contents())
    shapes = {t.name: [int(n) for n in t.shape] for t in r.tensors}
    mats = [shapes[f"blk.0.{t}.weight"] for t in lora_targets(args.lora_targets)]  # [n_in, n_out]
    n_trained = args.lora_rank * n_layer * sum(a + b for a, b in mats) if lora else m.n_params
    mib = 2**20
    return dict(
        weights=m.size / mib, gradients=4 * n_trained / mib, adamw_moments=8 * n_trained / mib,
        attention_matrices=0.0 if flash else 4 * args.batch * n_head * args.ctx**2 * n_layer / mib,
    )  # fmt: skip


# The profile's ops by kind: the attention's own ops; the matrix products (with the composed attention, its
# KQ and KQV products among them: the ops are timed by kind, not by node); the rest element-wise
# and normalization; the optimizer phase apart.
ATTENTION_OPS = ("FLASH_ATTN_EXT", "FLASH_ATTN_BACK", "SOFT_MAX", "SOFT_MAX_BACK")
PRODUCT_OPS = ("MUL_MAT", "OUT_PROD")


def kind_of(row: dict) -> str:
    op = row["op"].split("(")[0].strip().upper()
    if row["phase"] == "optimizer":
        return "optimizer"
    if op in ATTENTION_OPS:
        return "attention"
    if op in PRODUCT_OPS:
        return "matrix products"
    return "element-wise, norms, copies"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1b", help="bench/make_model.py shape (ignored with --model)")
    ap.add_argument("--model", default=None, help="an F32 GGUF instead of a random-weight llama")
    ap.add_argument("--configs", default="256x8,2048x1", help="ctx x batch, comma-separated")
    ap.add_argument("--qmodel", default=None, help="the quantized GGUF of the qlora mode (alone: qlora only)")
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--lora-targets", default="qv", help="qv or all (every linear layer of a block)")
    ap.add_argument(
        "--modes",
        default="pin,now",
        help="full fine-tunes: pin, now (F32 products, composed attention), fa (F32, flash attention), bf16 (the "
        "defaults: BF16 products, flash attention); lora (r8, F32 base), qlora (the defaults)",
    )
    ap.add_argument("-ngl", type=int, default=99)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--peak", type=float, default=494.7, help="the GPU's dense TF32 peak, TFLOP/s")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="now", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, default=256, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    from llamabind import train

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model, qmodel = args.model, args.qmodel
        if model is None and qmodel is not None and args.modes == "qlora":
            model = qmodel  # the shapes and FLOPs read from the quantized GGUF; no F32 copy
        elif model is None:
            qmodel = qmodel or str(Path(tmp) / "q4_0.gguf")
            subprocess.run([sys.executable, str(HERE / "make_model.py"), "--size", args.size, "--type", "q4_0",
                            "-o", qmodel], check=True)  # fmt: skip
            model = str(Path(tmp) / "f32.gguf")
            train.to_f32(qmodel, model)
        if "qlora" in args.modes.split(",") and qmodel is None:
            ap.error("--modes qlora with --model needs --qmodel (the quantized GGUF LoRA trains over)")
        for cfg in args.configs.split(","):
            ctx, batch = (int(x) for x in cfg.split("x"))
            fpt, shape = flops_per_token(model, ctx)
            for mode in args.modes.split(","):
                cmd = [sys.executable, __file__, "--worker", "--model", model, "--qmodel", str(qmodel), "--mode", mode,
                       "--ctx", str(ctx),
                       "--batch", str(batch), "-ngl", str(args.ngl), "--threads", str(args.threads),
                       "--steps", str(args.steps), "--profile-steps", str(args.profile_steps),
                       "--lora-rank", str(args.lora_rank), "--lora-targets", args.lora_targets]  # fmt: skip
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                gpu = GpuPeak(proc)
                stdout, stderr = proc.communicate()
                p = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
                if p.returncode != 0:
                    print(f"{mode} {cfg} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                    results.append(dict(mode=mode, ctx=ctx, batch=batch, error=p.stderr[-3000:]))
                    continue
                r = json.loads(p.stdout.strip().splitlines()[-1])
                r["memory"]["peak_gpu"] = gpu.peak_mb
                tok_s = batch * ctx / (r["step_ms"] / 1e3)
                if mode in ("lora", "qlora"):  # no base-weight gradients: 4 N + 8 L T d (bench/train.py's count)
                    f = 4 * shape["n_matmul_params"] + 8 * shape["n_layer"] * ctx * shape["n_embd"]
                else:
                    f = fpt
                r.update(tok_s=tok_s, tflops=f * tok_s / 1e12, mfu=f * tok_s / 1e12 / args.peak, **shape)
                results.append(r)
    _print(results, args)
    doc = dict(host=socket.gethostname(), date=datetime.date.today().isoformat(), args=vars(args), results=results)
    out = Path(args.out) if args.out else HERE / "results" / f"train-profile-{socket.gethostname()}-{doc['date']}.json"
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


def _print(results: list[dict], args) -> None:
    print(
        "\n| mode | ctx x batch | step ms | tok/s | TFLOP/s | MFU | build | alloc | inputs | compute | profiled sum |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | {r['ctx']}x{r['batch']} | failed | | | | | | | | |")
            continue
        s = r["per_step"]
        prof = sum(x["ms"] for x in r.get("profile", []))
        print(f"| {r['mode']} | {r['ctx']}x{r['batch']} | {r['step_ms']:.1f} | {r['tok_s']:,.0f} | {r['tflops']:.1f} | "
              f"{100 * r['mfu']:.1f}% | {s['t_build_ms']:.1f} | {s['t_alloc_ms']:.1f} | {s['t_inputs_ms']:.1f} | "
              f"{s['t_eval_ms']:.1f} | {prof:.1f} |")  # fmt: skip
    for r in results:
        if "profile" not in r:
            continue
        phases: dict[str, float] = {}
        for x in r["profile"]:
            phases[x["phase"]] = phases.get(x["phase"], 0.0) + x["ms"]
        print(f"\n{r['mode']} {r['ctx']}x{r['batch']}: profiled step {r['profiled_step_ms']:.1f} ms; "
              + ", ".join(f"{k} {v:.1f} ms" for k, v in phases.items()))  # fmt: skip
        kinds: dict[str, float] = {}
        for x in r["profile"]:
            kinds[kind_of(x)] = kinds.get(kind_of(x), 0.0) + x["ms"]
        r["by_kind_ms"] = kinds
        print("by kind: " + ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
        mem = r.get("memory", {})
        print("memory MiB: " + ", ".join(f"{k} {v:,.0f}" for k, v in mem.items() if v is not None))
        print("| phase | op | ms per step | nodes |")
        print("|---|---|---|---|")
        for x in r["profile"][:14]:
            print(f"| {x['phase']} | {x['op']} | {x['ms']:.2f} | {x['nodes']} |")


if __name__ == "__main__":
    sys.exit(main())
