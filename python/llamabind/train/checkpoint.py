"""Checkpoints of a fine-tune: the trained weights, AdamW's state, and where the run stood.

A checkpoint is a directory ``step-NNNNNNN/`` holding ``adapter.gguf`` (LoRA: the adapter as
``LoraAdapter.save`` writes it) or ``model.gguf`` (a full fine-tune: ``Model.save``),
``optimizer.npz`` (AdamW's first and second moments of every trained tensor, float32: patch 0028)
and ``state.json`` (the optimizer's step counter, the steps taken and the settings that fix the
order of the batches). It is written to a temporary directory and renamed, so a checkpoint that
exists is whole.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from .trainer import Trainer

__all__ = ["latest_checkpoint", "load_state", "save_checkpoint"]

VERSION = 1
STATE = "state.json"
OPTIMIZER = "optimizer.npz"
# the settings a resumed run must share with the run that wrote the checkpoint: they fix the
# windows, their order, the shapes of the trained tensors and (preference tuning) the loss
MUST_MATCH = (
    "kind", "ctx_size", "n_train", "batch_size", "seed", "shuffle", "optimizer", "embeddings", "lora", "method", "beta",
    "grpo",
)  # fmt: skip


def save_checkpoint(directory: str | os.PathLike, trainer: Trainer, weights: Any, state: dict) -> Path:
    """Write ``directory/step-{state['step']:07d}/`` (replacing one of that name) and return its
    path. ``weights``: the LoraAdapter being trained or the Model (full fine-tune). Reads the
    moments with Trainer.state (ggml_opt_get_param, patch 0028). Raises OSError if the
    directory cannot be written, ValueError before the optimizer's first step."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state['step']:07d}"
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    it, params = trainer.state()
    arrays: dict[str, Any] = {}
    for i, (_, m, v) in enumerate(params):
        arrays[f"m{i}"], arrays[f"v{i}"] = m, v
    np.savez(str(tmp / OPTIMIZER), **arrays)
    weights.save(tmp / ("model.gguf" if state["kind"] == "full" else "adapter.gguf"))
    meta = dict(state, version=VERSION, iter=int(it), params=[n for n, _, _ in params])
    (tmp / STATE).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def latest_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a checkpoint, else its newest ``step-*`` checkpoint. Raises
    FileNotFoundError if there is none."""
    p = Path(path)
    if (p / STATE).is_file():
        return p
    steps = sorted(c for c in p.glob("step-*") if (c / STATE).is_file()) if p.is_dir() else []
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {p} (a step-NNNNNNN directory with {STATE})")
    return steps[-1]


def load_state(path: str | os.PathLike) -> tuple[Path, dict]:
    """(checkpoint directory, its state.json) of ``path`` (a checkpoint or a directory of them).
    Raises FileNotFoundError, ValueError for a file that is not one of ours or is incomplete."""
    ckpt = latest_checkpoint(path)
    try:
        state = json.loads((ckpt / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{ckpt / STATE}: not a readable checkpoint state ({err})") from None
    if not isinstance(state, dict) or state.get("version") != VERSION:
        raise ValueError(f"{ckpt / STATE}: not a llamabind checkpoint of version {VERSION}")
    step, total, losses = state.get("step"), state.get("total"), state.get("losses")
    if not (
        isinstance(step, int) and isinstance(total, int) and isinstance(losses, list) and 1 <= step <= total
        and len(losses) == step
    ):  # fmt: skip
        raise ValueError(
            f"{ckpt / STATE}: step {step!r} of {total!r} with {len(losses) if isinstance(losses, list) else '?'} "
            "losses is not a checkpoint's position (1 <= step <= total, one loss per step)"
        )
    weights = ckpt / ("model.gguf" if state.get("kind") == "full" else "adapter.gguf")
    for f in (weights, ckpt / OPTIMIZER):
        if not f.is_file():
            raise ValueError(f"checkpoint {ckpt} is incomplete: no {f.name}")
    return ckpt, state


def check_matches(state: dict, run: dict, ckpt: Path) -> None:
    """ValueError naming each setting of ``run`` that differs from the checkpoint's."""
    diff = [f"{k} {state.get(k)!r} there, {run.get(k)!r} now" for k in MUST_MATCH if state.get(k) != run.get(k)]
    if diff:
        raise ValueError(f"cannot resume from {ckpt}: the run differs in " + "; ".join(diff))


def restore_optimizer(trainer: Trainer, ckpt: Path, state: dict) -> None:
    """Put the checkpoint's AdamW moments and step counter into ``trainer``'s optimizer (after its
    first step or evaluation, which allocates them)."""
    try:
        with np.load(ckpt / OPTIMIZER) as z:
            params = [(n, z[f"m{i}"], z[f"v{i}"]) for i, n in enumerate(state["params"])]
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as err:  # truncated, overwritten
        raise ValueError(f"{ckpt / OPTIMIZER}: not the optimizer state of this checkpoint ({err})") from None
    trainer.set_state(state["iter"], params)
