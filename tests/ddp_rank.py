"""One process of tests/test_train_ddp.py's runs: train.finetune (full, SGD, one thread) of a job's model on its
token ids (a job with "pairs": train.preference on those pairs of token ids, its "method"; with "prompts":
train.grpo on them, its GRPOConfig "grpo"), as one process or
as a rank of a torchrun-style launch (the environment says which); writes the result
(losses, validation losses, steps) to OUT/result-RANK.json and, on rank 0, the trained model to OUT/model.gguf
(a LoRA run: its adapter, OUT/adapter.gguf). A job's "die": [rank, step] ends that rank after that step; "resume": a
checkpoint to resume (every rank reads it). Run with the project's Python and PYTHONPATH naming a site-packages with
torch (the reference venv's)."""

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np

import llamabind
from llamabind import train


def _length_reward(completions, **kw):
    return [len(c) / 10 for c in completions]


def main(job_file: str) -> None:
    job = json.loads(Path(job_file).read_text())
    out = Path(job["out"])
    rank = int(os.environ.get("RANK", "0"))
    tokens = np.asarray(job["tokens"], dtype=np.int32)
    kw = {}
    if job.get("gpu") and "LOCAL_RANK" in os.environ:  # a rank's GPU, as the CLI's (cli/ddp.py)
        kw = dict(split_mode="none", main_gpu=int(os.environ["LOCAL_RANK"]))
    with llamabind.Model(job["model"], use_mmap=False, n_threads=1, **kw) as m:

        def on_step(step: int, loss: float) -> None:
            if job.get("die") == [rank, step]:  # a rank that dies after a step: the others must not hang
                os._exit(3)

        args = train.TrainingArgs(**job["args"])
        if "prompts" in job:  # train.grpo on the prompts, reward: a completion's length / 10
            res = train.grpo(m, job["prompts"], _length_reward, args, train.GRPOConfig(**job["grpo"]),
                             resume=job.get("resume"))  # fmt: skip
        elif "pairs" in job:  # train.preference on pairs of token ids (prompt, chosen, rejected)
            pairs = [train.PreferencePair(*(np.asarray(x, np.int32) for x in p)) for p in job["pairs"]]
            res = train.preference(m, pairs, args, method=job["method"], resume=job.get("resume"))
        else:
            res = train.finetune(m, tokens, args, on_step=on_step, resume=job.get("resume"))
        if rank == 0:
            (res.adapter or m).save(out / ("adapter.gguf" if res.adapter else "model.gguf"))
    if "prompts" in job:
        keep = ("loss", "kl", "reward", "reward_std", "completions/mean_length", "clip_ratio/region_mean")
        row = dict(
            losses=res.losses,
            metrics=[{k: v for k, v in x.items() if k in keep} for x in res.metrics],
            val_before=res.val_before,
            val=[v for _, v in res.evals],
            steps=res.steps,
            checkpoints=len(res.checkpoints),
        )
    elif "pairs" in job:
        row = dict(
            losses=res.losses,
            metrics=[dataclasses.asdict(x) for x in res.metrics],
            val_before=dataclasses.asdict(res.val_before) if res.val_before else None,
            val=[dataclasses.asdict(x) for _, x in res.evals],
            steps=res.steps,
            checkpoints=len(res.checkpoints),
        )
    else:
        row = dict(
            losses=res.losses,
            val_before=res.val_loss_before,
            val=[e.val_loss for e in res.epochs],
            steps=res.steps,
            checkpoints=len(res.checkpoints),
        )
    (out / f"result-{rank}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    main(sys.argv[1])
