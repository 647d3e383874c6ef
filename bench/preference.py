#!/usr/bin/env python3
"""DPO throughput and peak memory (issue 58 item 6): llamabind's train.preference (LoRA r8, QLoRA, full)
beside a PyTorch DPO loop (transformers' LlamaForCausalLM from the same F32 GGUF, peft LoRA r8 on q_proj/v_proj
or every weight, bf16 autocast, SDPA attention: what TRL's DPOTrainer runs, written out because TRL is not
installed where the GPU is) in one run, on the same pairs, each runner its own process.

    python bench/preference.py [--model smollm2-135m-instruct | --size 1b] [--ctx 256] [--batch 8]
        [--steps 12] [--runners lora,qlora,full,lora-pack,full-pack] [--torch PYTHON] [--torch-device cuda]
        [--torch-runs lora,full] [--out FILE.json]

Pairs: Python's reference text (pydoc_data.topics): the prompt a topic's first ctx/2 tokens, the chosen answer
the next 3/8 ctx tokens, the rejected answer as many tokens of the next topic (a wrong topic's answer), so each
sequence is 7/8 ctx tokens: llamabind puts each in a window of ctx tokens (pack=False; the ``-pack`` runners:
pack=True, a step's pairs in one window with each prompt once), PyTorch pads a batch's sequences to the longest
(the same here). Both: DPO's sigmoid loss, beta 0.1, the reference log-probabilities precomputed
before the first step (TRL's precompute_ref_log_probs), AdamW (LoRA lr 1e-4, full 1e-6), batch pairs a step.
"pairs/s": batch over the median step time after the first; peak GPU memory from nvidia-smi (the CUDA context
included, every runner alike). Prints a table and writes bench/results/preference-<host>-<date>.json (--out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from train import base_models, run_process  # noqa: E402 - bench/train.py: the models, a process with its GPU peak

RANK, LR_LORA, LR_FULL, BETA = 8, 1e-4, 1e-6, 0.1


def make_pairs(model_path: Path, ctx: int, n: int) -> list[list[list[int]]]:
    """[[prompt, chosen, rejected] token ids] of n pairs from pydoc_data.topics (see the module's docstring)."""
    from pydoc_data.topics import topics

    import llamabind

    p_len, a_len = ctx // 2, 3 * ctx // 8
    with llamabind.Model(model_path, vocab_only=True) as v:
        toks = [v.tokenize(topics[k], add_special=False) for k in sorted(topics)]
    toks = [t for t in toks if len(t) >= p_len + a_len]
    pairs = []
    for i in range(n):
        t, other = toks[i % len(toks)], toks[(i + 1) % len(toks)]
        pairs.append([t[:p_len], t[p_len : p_len + a_len], other[p_len : p_len + a_len]])
    return pairs


def worker_llamabind(args) -> dict:
    import numpy as np

    import llamabind
    from llamabind import train

    pairs = [
        train.PreferencePair(*(np.asarray(x, np.int32) for x in p)) for p in json.loads(Path(args.data).read_text())
    ]
    kind, _, pack = args.worker.partition("-")
    lora = kind != "full"
    times: list[float] = []
    with llamabind.Model(args.model, use_mmap=lora, repack=False, n_gpu_layers=-1) as m:
        r = train.preference(
            m, pairs, method="dpo", beta=BETA, ctx_size=args.ctx, batch_size=args.batch, iters=args.steps,
            lora_rank=RANK if lora else None, lr=LR_LORA if lora else LR_FULL, val_split=0.0, shuffle=False,
            pack=bool(pack), progress=False, on_step=lambda step, metrics: times.append(time.perf_counter()),
        )  # fmt: skip
    steps = [b - a for a, b in zip(times, times[1:])]
    return dict(steps=r.steps, step_times=steps, loss_first=r.losses[0], loss_last=r.losses[-1])


TORCH_WORKER = r"""
import json, sys, time
import torch, torch.nn.functional as F
from transformers import AutoModelForCausalLM
from pathlib import Path
cfg = json.loads(Path(sys.argv[1]).read_text())
dev = torch.device(cfg["device"])
p = Path(cfg["model"])
m = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32,
                                         attn_implementation="sdpa").to(dev).train()
if cfg["lora"]:
    from peft import LoraConfig, get_peft_model
    m = get_peft_model(m, LoraConfig(r=cfg["rank"], lora_alpha=2 * cfg["rank"], lora_dropout=0.0,
                                     target_modules=["q_proj", "v_proj"]))
pairs, B, beta = cfg["pairs"], cfg["batch"], cfg["beta"]

def batch_of(idx):
    seqs, starts = [], []
    for i in idx:
        prompt, chosen, rejected = pairs[i]
        for a in (chosen, rejected):
            seqs.append(prompt + a)
            starts.append(len(prompt))
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    lab = torch.full((len(seqs), T), -100, dtype=torch.long)
    for k, (s, st) in enumerate(zip(seqs, starts)):
        ids[k, :len(s)] = torch.tensor(s)
        mask[k, :len(s)] = 1
        lab[k, st:len(s)] = torch.tensor(s[st:])
    return ids.to(dev), mask.to(dev), lab.to(dev)

def logps(ids, mask, lab):
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        logits = m(input_ids=ids, attention_mask=mask).logits[:, :-1]
    lab = lab[:, 1:]
    lp = torch.gather(F.log_softmax(logits.float(), -1), 2, lab.clamp(min=0)[..., None])[..., 0]
    return (lp * (lab >= 0)).sum(-1)

n_batches = len(pairs) // B
refs = []
with torch.no_grad():  # TRL's precompute_ref_log_probs: the model as it starts
    for s in range(n_batches):
        refs.append(logps(*batch_of(range(s * B, (s + 1) * B))))
opt = torch.optim.AdamW([q for q in m.parameters() if q.requires_grad], lr=cfg["lr"], weight_decay=0.0)
times, losses = [], []
torch.cuda.reset_peak_memory_stats() if dev.type == "cuda" else None
for s in range(cfg["steps"]):
    b = s % n_batches
    lp = logps(*batch_of(range(b * B, (b + 1) * B)))
    z = beta * ((lp[0::2] - lp[1::2]) - (refs[b][0::2] - refs[b][1::2]))
    loss = -F.logsigmoid(z).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    losses.append(loss.item())  # synchronizes
    times.append(time.perf_counter())
print(json.dumps(dict(steps=len(times), step_times=[b - a for a, b in zip(times, times[1:])],
      loss_first=losses[0], loss_last=losses[-1],
      peak_alloc_mb=torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None)))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model name or a quantized GGUF")
    ap.add_argument("--size", default=None, help="a random-weight llama of this bench/make_model.py shape instead")
    ap.add_argument("--ctx", type=int, default=256, help="tokens per window (a sequence is 7/8 of it)")
    ap.add_argument("--batch", type=int, default=8, help="pairs per optimizer step")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per runner")
    ap.add_argument("--runners", default="lora,qlora,full", help="llamabind's: lora, qlora, full (-pack: packed pairs)")
    ap.add_argument("--torch", default=None, help="python with torch + transformers + peft")
    ap.add_argument("--torch-device", default="cuda")
    ap.add_argument("--torch-runs", default="lora,full", help="PyTorch's: lora (peft), full; bf16 autocast")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker_llamabind(args)))
        return 0

    import llamabind

    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        quant, f32 = base_models(args.size, args.model, tmpd)
        pairs = make_pairs(f32, args.ctx, args.batch * args.steps)
        data = tmpd / "pairs.json"
        data.write_text(json.dumps(pairs))
        with llamabind.Model(quant, vocab_only=True) as v:
            desc = f"{quant.name} ({v.n_params / 1e6:.0f} M parameters)"
        paths = {"lora": f32, "qlora": quant, "full": f32}
        for r in args.runners.split(","):
            kind, _, pack = r.partition("-")
            cmd = [sys.executable, __file__, "--worker", r, "--model", str(paths[kind]), "--data", str(data)]
            cmd += ["--ctx", str(args.ctx), "--batch", str(args.batch), "--steps", str(args.steps)]
            name = {"lora": f"LoRA r{RANK}", "qlora": f"QLoRA r{RANK}", "full": "full"}[kind]
            name += " packed" if pack else ""
            try:
                out, _, gpu_mb = run_process(cmd)
                rows[f"llamabind DPO {name}"] = {**json.loads(out.strip().splitlines()[-1]), "peak_gpu_mb": gpu_mb}
            except RuntimeError as err:
                rows[f"llamabind DPO {name}"] = dict(error=str(err)[-600:])
        for r in args.torch_runs.split(",") if args.torch else []:
            job = tmpd / "torch-job.json"
            job.write_text(json.dumps(dict(model=str(f32), device=args.torch_device, lora=r == "lora", rank=RANK,
                                           pairs=pairs, batch=args.batch, steps=args.steps, beta=BETA,
                                           lr=LR_LORA if r == "lora" else LR_FULL)))  # fmt: skip
            name = f"PyTorch DPO {'peft LoRA r8' if r == 'lora' else 'full'} bf16"
            try:
                out, _, gpu_mb = run_process([args.torch, "-c", TORCH_WORKER, str(job)])
                rows[name] = {**json.loads(out.strip().splitlines()[-1]), "peak_gpu_mb": gpu_mb}
            except RuntimeError as err:
                oom = "out of memory" in str(err).lower()
                rows[name] = dict(error="out of memory" if oom else str(err)[-600:])

    print(f"\n{desc}, DPO beta {BETA}, {args.batch} pairs a step, sequences of {7 * args.ctx // 8} tokens")
    print(f"| {'runner':34s} | steps | pairs/s | loss first -> last | peak GPU MiB |")
    print(f"|{'-' * 36}|-------|---------|--------------------|--------------|")
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name:34s} | {r['error'][:80]} |")
            continue
        r["pairs_s"] = args.batch / statistics.median(r["step_times"]) if r["step_times"] else float("nan")
        gm = r.get("peak_gpu_mb")
        print(f"| {name:34s} | {r['steps']:5d} | {r['pairs_s']:7.2f} | {r['loss_first']:.4f} -> {r['loss_last']:.4f} | "
              f"{'-' if gm is None else gm:>12} |")  # fmt: skip
    result = {
        "host": socket.gethostname(), "platform": platform.platform(), "date": datetime.date.today().isoformat(),
        "model": desc, "args": vars(args), "build": llamabind.build_info(), "rows": rows,
    }  # fmt: skip
    out_path = (
        Path(args.out) if args.out else HERE / "results" / f"preference-{socket.gethostname()}-{result['date']}.json"
    )
    out_path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
