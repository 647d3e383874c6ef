#!/usr/bin/env python3
"""GRPO steps (issue 85 item 7): llamabind's train.grpo (rollouts by llama.cpp's batched decode, LoRA r8 over the
F32 model, QLoRA over Q4_0) beside TRL 1.16's GRPOTrainer with transformers' generate (peft LoRA r8, bf16; vLLM is
not on the GPU machine) in one run, on the same model shape, prompts, G, lengths and reward, each runner its own
process.

    python bench/grpo.py [--size 1b | --model smollm2-135m-instruct] [--prompts 4] [--num-generations 8]
        [--completion 256] [--steps 5] [--runners lora,qlora,lora-gc] [--trl PYTHON] [--out FILE.json]

Prompts: the first 300 characters of Python's reference topics (pydoc_data.topics), as text (each side tokenizes
them). Reward: the completion's length in characters / 1000 (cheap; a random-weight model never ends a completion,
so every completion is max_completion_length tokens on both sides: the same work). TRL's GRPOConfig turns gradient
checkpointing on by default: the -gc runners do so too, for memory compared like for like. Both: TRL's defaults
otherwise (dapo loss, beta 0, temperature 1, no top_k/top_p), lr 1e-5, one optimizer step per generation batch of
prompts x G completions. Seconds per step: the median after the first; rollout tokens/s: completion tokens over
the time the rollouts took (llamabind's); peak GPU memory from nvidia-smi. Prints a table and writes
bench/results/grpo-<host>-<date>.json (--out).
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

RANK, LR = 8, 1e-5


def make_prompts(n: int) -> list[str]:
    from pydoc_data.topics import topics

    texts = [topics[k][:300] for k in sorted(topics) if len(topics[k]) >= 300]
    return [texts[i % len(texts)] for i in range(n)]


def worker_llamabind(args) -> dict:
    import llamabind
    from llamabind import train

    prompts = json.loads(Path(args.data).read_text())
    times: list[float] = []
    with llamabind.Model(args.model, repack=False, n_gpu_layers=-1) as m:
        r = train.grpo(
            m, prompts, lambda completions, **kw: [len(c) / 1000 for c in completions], lora_rank=RANK, lr=LR,
            batch_size=args.prompts * args.num_generations, iters=args.steps, val_split=0.0, progress=False,
            config=train.GRPOConfig(num_generations=args.num_generations, max_completion_length=args.completion),
            on_step=lambda s, mt: times.append(time.perf_counter()),
            gradient_checkpointing="-gc" in args.worker,
            loss_chunk_tokens=0 if args.worker.endswith("-whole") else None,
        )  # fmt: skip
    ms = r.metrics
    return dict(step_times=[round(b - a, 4) for a, b in zip(times, times[1:])],
                rollout_tok_s=statistics.median(x["rollout_tokens_per_s"] for x in ms),
                rollout_s=statistics.median(x["time/rollout_s"] for x in ms[1:] or ms),
                sample_s=statistics.median(x["time/rollout_sample_s"] for x in ms[1:] or ms),
                train_s=statistics.median(x["time/train_s"] for x in ms[1:] or ms),
                completion_len=statistics.mean(x["completions/mean_length"] for x in ms))  # fmt: skip


TRL_WORKER = r"""
import json, sys, time, tempfile
from pathlib import Path
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
cfg = json.loads(Path(sys.argv[1]).read_text())
p = Path(cfg["model"])
tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
model.hf_quantizer, model.is_quantized = None, False  # dequantized at load; the mark would refuse training
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
times = []
class T(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter())
with tempfile.TemporaryDirectory() as tmp:
    conf = GRPOConfig(output_dir=tmp, per_device_train_batch_size=cfg["prompts"] * cfg["G"], num_generations=cfg["G"],
                      max_completion_length=cfg["completion"], max_steps=cfg["steps"], learning_rate=cfg["lr"],
                      logging_steps=1, report_to=[], bf16=torch.cuda.is_available(), save_strategy="no", seed=0,
                      use_cpu=not torch.cuda.is_available())
    tr = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [len(c) / 1000 for c in completions],
                     args=conf, train_dataset=Dataset.from_list([{"prompt": q} for q in cfg["prompts_text"]]),
                     processing_class=tok, peft_config=LoraConfig(r=cfg["rank"], lora_alpha=2 * cfg["rank"],
                     lora_dropout=0.0, target_modules=["q_proj", "v_proj"]), callbacks=[T()])
    tr.train()
    lens = [e["completions/mean_length"] for e in tr.state.log_history if "completions/mean_length" in e]
print(json.dumps(dict(step_times=[round(b - a, 4) for a, b in zip(times, times[1:])],
                      completion_len=sum(lens) / max(len(lens), 1),
                      peak_alloc_mb=torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None)))
"""


def done(name: str, row: dict) -> None:
    """One line a row as it ends (a run cut short keeps what it measured)."""
    what = row.get("error", "")[-200:] or f"step_times {row.get('step_times')} GPU MiB {row.get('peak_gpu_mb')}"
    print(f"row done: {name}: {what}", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model name or a quantized GGUF")
    ap.add_argument("--size", default=None, help="a random-weight llama of this bench/make_model.py shape instead")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--completion", type=int, default=256, help="max_completion_length")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--runners",
        default="lora,qlora,lora-gc",
        help="llamabind's: lora (F32 base), qlora (Q4_0 base); -gc: with gradient checkpointing (TRL's GRPOConfig "
        "turns it on by default); -whole (last): each micro-batch's loss unsplit (loss_chunk_tokens=0), the memory "
        "before train.grpo.loss_splits",
    )
    ap.add_argument("--trl", default=None, help="python with torch, transformers, peft, trl")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--data", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker_llamabind(args)))
        return 0

    import llamabind

    rows: dict[str, dict] = {}
    prompts = make_prompts(args.prompts * args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        quant, f32 = base_models(args.size, args.model, tmpd)
        data = tmpd / "prompts.json"
        data.write_text(json.dumps(prompts))
        with llamabind.Model(quant, vocab_only=True) as v:
            desc = f"{quant.name} ({v.n_params / 1e6:.0f} M parameters)"
        common = ["--prompts", str(args.prompts), "--num-generations", str(args.num_generations), "--completion",
                  str(args.completion), "--steps", str(args.steps), "--data", str(data)]  # fmt: skip
        for r in args.runners.split(","):
            path = {"lora": f32, "qlora": quant}[r.removesuffix("-whole").removesuffix("-gc")]
            name = f"llamabind {'QLoRA (' + quant.name + ')' if r.startswith('qlora') else 'LoRA'} r{RANK}"
            name += " gradient checkpointing" if "-gc" in r else ""
            name += " loss unsplit" if r.endswith("-whole") else ""
            try:
                out, _, gpu_mb = run_process([sys.executable, __file__, "--worker", r, "--model", str(path), *common])
                rows[name] = {**json.loads(out.strip().splitlines()[-1]), "peak_gpu_mb": gpu_mb}
            except RuntimeError as err:
                rows[name] = dict(error=str(err)[-600:])
            done(name, rows[name])
        if args.trl:
            job = tmpd / "trl-job.json"
            job.write_text(json.dumps(dict(model=str(f32), prompts=args.prompts, G=args.num_generations,
                                           completion=args.completion, steps=args.steps, lr=LR, rank=RANK,
                                           prompts_text=prompts)))  # fmt: skip
            name = f"TRL GRPOTrainer, peft LoRA r{RANK} bf16, transformers generate"
            try:
                out, _, gpu_mb = run_process([args.trl, "-c", TRL_WORKER, str(job)])
                rows[name] = {**json.loads(out.strip().splitlines()[-1]), "peak_gpu_mb": gpu_mb}
            except RuntimeError as err:
                rows[name] = dict(error=str(err)[-600:])
            done(name, rows[name])
    n = args.prompts * args.num_generations
    print(f"\n{desc}, GRPO: {args.prompts} prompts x G {args.num_generations} = {n} completions of up to "
          f"{args.completion} tokens a step")  # fmt: skip
    print(
        "| runner | s / step | rollout s | of it sampling s | train s | rollout tok/s | completion tokens | GPU MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    ref = None
    for name, r in rows.items():
        if "error" in r:
            print(f"| {name} | {r['error'][:100]} |")
            continue
        r["s_per_step"] = statistics.median(r["step_times"]) if r["step_times"] else float("nan")
        ref = r["s_per_step"] if name.startswith("TRL") else ref
        print(f"| {name} | {r['s_per_step']:.2f} | {r.get('rollout_s', float('nan')):.2f} | "
              f"{r.get('sample_s', float('nan')):.2f} | "
              f"{r.get('train_s', float('nan')):.2f} | {r.get('rollout_tok_s', float('nan')):.0f} | "
              f"{r['completion_len']:.0f} | {r.get('peak_gpu_mb')} |")  # fmt: skip
    if ref:
        for name, r in rows.items():
            if "s_per_step" in r and not name.startswith("TRL"):
                print(f"{name}: {ref / r['s_per_step']:.2f}x TRL's speed per step")
    result = {
        "host": socket.gethostname(), "platform": platform.platform(), "date": datetime.date.today().isoformat(),
        "model": desc, "args": vars(args), "build": llamabind.build_info(), "rows": rows,
    }  # fmt: skip
    out_path = Path(args.out) if args.out else HERE / "results" / f"grpo-{socket.gethostname()}-{result['date']}.json"
    out_path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
