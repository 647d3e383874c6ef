"""The training loop: windows in, optimizer steps through llama.cpp's llama_opt_epoch."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from .._validate import as_float, as_int, expect, one_of
from ..context import Context
from ..model import LoraAdapter, Model
from .checkpoint import check_matches, load_state, restore_optimizer, save_checkpoint
from .data import Example, example_windows, windows
from .lora import lora_init
from .schedule import check_schedule, lr_at

__all__ = ["EpochStats", "TrainResult", "finetune"]


@dataclass
class EpochStats:
    """One epoch: mean next-token cross-entropy per token (nats) on the train and validation
    windows, next-token accuracy, training throughput (tokens/s), wall time of the training
    steps and of the validation (s)."""

    epoch: int
    train_loss: float
    val_loss: float
    train_accuracy: float
    val_accuracy: float
    tokens_per_s: float
    seconds: float
    val_seconds: float = 0.0


@dataclass
class TrainResult:
    """What :func:`finetune` did: per-epoch stats, the trained LoRA adapter (None for a full
    fine-tune), the validation loss before training, optimizer
    steps taken, the per-step train losses, and whether Ctrl-C stopped it early (the weights
    then hold the steps taken), the validations (step, loss) in between, and the checkpoints
    written. ``steps`` and ``losses`` count from the start of the run a checkpoint resumed."""

    epochs: list[EpochStats] = field(default_factory=list)
    adapter: LoraAdapter | None = None
    val_loss_before: float = math.nan
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    interrupted: bool = False
    evals: list[tuple[int, float]] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)


def _check_model(model: Model, lora: bool) -> None:
    if not isinstance(model, Model):
        raise TypeError(f"model must be a llamabind.Model; got {type(model).__name__}")
    all_f32 = model.size == 4 * model.n_params
    if lora:
        if not all_f32 and model.repack:
            raise ValueError(
                "LoRA training over a quantized model needs its weights in the GGUF's layout: load it with "
                "Model(path, repack=False) (the backward pass reads them with ggml's plain kernels)"
            )
        return
    if model.use_mmap:
        raise ValueError("fine-tuning writes the weights: load the model with Model(path, use_mmap=False)")
    if not all_f32:
        raise ValueError(
            f"full fine-tuning needs F32 weights; this model is {model.description!r}. Convert it with "
            "llamabind.train.to_f32(src, dst) (or `python -m llamabind finetune`, which does), or train a "
            "LoRA adapter over it as it is (lora_rank=...)."
        )


TIED_EMBEDDINGS = (
    "{model}: its output matrix is token_embd.weight (tied embeddings), which a full fine-tune leaves as it is: "
    "llama.cpp's llama_opt_init never makes token_embd a parameter (llama_set_param skips it by name, a FIXME at "
    "the pin: its input lookup runs on the CPU through GET_ROWS, and a tied model's output matrix is a second copy "
    "of it that training would untie). Every other F32 weight is trained; the PyTorch reference freezes it too."
)


def finetune(
    model: Model,
    data: str | Sequence[int] | Sequence[Example],
    *,
    valid: str | Sequence[int] | Sequence[Example] | None = None,
    ctx_size: int = 256,
    epochs: int = 1,
    iters: int | None = None,
    lr: float = 1e-5,
    optimizer: str = "adamw",
    weight_decay: float = 0.0,
    val_split: float = 0.1,
    batch_size: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    n_threads: int | None = None,
    progress: bool = True,
    on_step: Callable[[int, float], Any] | None = None,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    lora_targets: Sequence[str] = ("attn_q", "attn_v"),
    lr_schedule: str = "constant",
    warmup: int = 0,
    min_lr: float = 0.0,
    steps_per_eval: int | None = None,
    steps_per_report: int | None = None,
    log: str | os.PathLike | None = None,
    checkpoint_dir: str | os.PathLike | None = None,
    save_every: int | None = None,
    resume: str | os.PathLike | None = None,
) -> TrainResult:
    """Fine-tune ``model`` on ``data``: every weight (F32, loaded with use_mmap=False), or with
    ``lora_rank`` a new LoRA adapter over the frozen model (any weight type; repack=False).

    Args:
        data: text (tokenized with the model's tokenizer, BOS added; sliding windows), token ids,
            shape (n,), any integer dtype, each in [0, n_vocab), or a list of :class:`Example`
            (e.g. from :func:`load_jsonl`: one per window, cut or padded, the loss on their
            counted tokens only).
        valid: held-out data of the same kinds for the validation loss, instead of ``val_split``.
        ctx_size: tokens per window (n_ctx = n_batch = n_ubatch of the training context); a
            multiple of 256 (llama.cpp pads contexts to 256).
        epochs: passes over the train windows (shuffled each epoch with ``seed`` unless
            ``shuffle`` is False: then in order, as llama-finetune).
        iters: optimizer steps in all (mlx-lm's ``--iters``), instead of ``epochs``: as many
            passes as they need, the last one cut short.
        lr, optimizer, weight_decay: ggml-opt's ``"adamw"`` (beta1 0.9, beta2 0.999) or ``"sgd"``.
        val_split: fraction of the windows (the last ones) held out for the validation loss;
            0 for none.
        batch_size: windows per optimizer step (gradient accumulation, patch 0025: the step
            follows the mean loss of the batch). An epoch's last batch is filled up with windows
            from the start of its order, so every train window counts at least once per epoch.
        progress: a tqdm bar with the loss and tokens/s.
        on_step: called as on_step(step, loss) after each optimizer step.
        lora_rank, lora_alpha, lora_targets: train a LoRA adapter of this rank (alpha default
            2 * rank) on these matrices of every layer (see :data:`LORA_TARGETS`), made by
            :func:`lora_init` with ``seed``; returned as ``result.adapter``.
        lr_schedule, warmup, min_lr: ``"constant"``, ``"cosine"`` or ``"linear"`` decay from lr
            towards min_lr over the run, after ``warmup`` steps of linear warmup
            (:func:`lr_at`); set before each step (ggml-opt reads it per step).
        steps_per_eval: also validate every N steps (``result.evals``: (step, loss)).
        steps_per_report: print a line every N steps to stderr: step, loss, lr, tokens/s, ETA.
        log: a JSONL file, one object per step (step, epoch, loss, lr, tokens, tokens_per_s,
            seconds) and per validation (step, val_loss, val_accuracy).
        checkpoint_dir, save_every: write a checkpoint (:mod:`llamabind.train.checkpoint`: the
            adapter or the model, AdamW's moments and step counter, the run's position) to
            ``checkpoint_dir/step-NNNNNNN/`` every ``save_every`` steps, at the end, and when
            Ctrl-C stops the run. All are kept (a full fine-tune's is 3x the F32 model's size).
        resume: a checkpoint (or a checkpoint_dir: its newest) to continue from, to the same
            weights as the uninterrupted run: same data, ctx_size, batch_size, seed, shuffle,
            optimizer and LoRA rank/alpha/targets (ValueError naming what differs); the steps
            continue from the checkpoint's (``iters`` and the schedule count the whole run). A
            LoRA run loads the checkpoint's adapter; a full fine-tune must be given the model
            loaded from its ``model.gguf``.

    Returns a :class:`TrainResult`. Ctrl-C stops between steps and returns what was trained
    (``interrupted``: True); the model stays usable.

    A full fine-tune never trains ``token_embd.weight`` (llama.cpp leaves it out); in a model with
    tied embeddings (SmolLM2, Gemma: no ``output.weight``) that is also the output matrix, and a
    UserWarning says so (:data:`TIED_EMBEDDINGS`).

    Raises TypeError/ValueError for bad arguments (rank <= 0, an unknown target, batch_size
    outside [1, 65536], iters < 1), data shorter
    than one window, a full fine-tune of a model that is not F32 or is memory-mapped;
    FloatingPointError naming the step if the loss becomes NaN/inf.
    """
    lora = lora_rank is not None
    _check_model(model, lora)
    if not lora and not any(name == "output.weight" for name, _, _ in model.tensor_info()):
        warnings.warn(TIED_EMBEDDINGS.format(model=model.path.name), UserWarning, stacklevel=2)
    ctx_size = as_int(ctx_size, "ctx_size", 256)
    expect(ctx_size % 256 == 0, f"ctx_size must be a multiple of 256 (llama.cpp pads n_ctx to 256); got {ctx_size}")
    epochs = as_int(epochs, "epochs", 1)
    if iters is not None:
        iters = as_int(iters, "iters", 1)
    lr = as_float(lr, "lr")
    expect(lr > 0, f"lr must be > 0; got {lr}")
    one_of(optimizer, "optimizer", ("adamw", "sgd"))
    val_split = as_float(val_split, "val_split", 0.0, 0.9)
    batch_size = as_int(batch_size, "batch_size", 1)
    warmup, min_lr = check_schedule(lr_schedule, warmup, lr, min_lr)
    eval_every = None if steps_per_eval is None else as_int(steps_per_eval, "steps_per_eval", 1)
    report_every = None if steps_per_report is None else as_int(steps_per_report, "steps_per_report", 1)
    win, lab = _windows(model, data, ctx_size, "data")
    if valid is not None:
        val_win, val_lab = _windows(model, valid, ctx_size, "valid")
        n_train = len(win)
    else:
        n_train = int(len(win) * (1.0 - val_split))  # as llama-finetune's idata_split
        if n_train < 1:
            raise ValueError(f"{len(win)} window(s) leave none to train on with val_split={val_split}")
        val_win, val_lab = win[n_train:], (None if lab is None else lab[n_train:])
        win, lab = win[:n_train], (None if lab is None else lab[:n_train])
    n_batches = -(-n_train // batch_size)
    if iters is not None:
        epochs = -(-iters // n_batches)
    total = iters if iters is not None else epochs * n_batches
    rank = None if not lora else as_int(lora_rank, "lora_rank", 1)
    alpha = None if rank is None else as_float(2.0 * rank if lora_alpha is None else lora_alpha, "lora_alpha")
    run_id = dict(
        kind="lora" if lora else "full", ctx_size=ctx_size, n_train=n_train, batch_size=batch_size, seed=seed,
        shuffle=bool(shuffle), optimizer=optimizer,
        lora=None if rank is None else dict(rank=rank, alpha=alpha, targets=list(lora_targets)),
    )  # fmt: skip
    save_every = None if save_every is None else as_int(save_every, "save_every", 1)
    expect(save_every is None or checkpoint_dir is not None, "save_every needs a checkpoint_dir")
    resumed = None if resume is None else load_state(resume)
    if resumed is not None:
        check_matches(resumed[1], run_id, resumed[0])
        if not lora and Path(model.path).resolve() != (resumed[0] / "model.gguf").resolve():
            raise ValueError(
                f"resuming a full fine-tune: load the model from the checkpoint, "
                f"Model({str(resumed[0] / 'model.gguf')!r}, use_mmap=False); got {model.path}"
            )
    rng = np.random.default_rng(seed)
    result = TrainResult()
    run = _Run(
        ctx=None, train=(win, lab), val=(val_win, val_lab), total=total, epochs=epochs, progress=progress,
        on_step=on_step, lr=lambda step: lr_at(step, total, lr, lr_schedule, warmup, min_lr),
        eval_every=eval_every, report_every=report_every,
        log=None, save_every=save_every,
    )  # fmt: skip
    if lora:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "lora-init.gguf")
            if resumed is None:
                assert rank is not None and alpha is not None
                lora_init(model, path, rank, alpha, lora_targets, seed)
            result.adapter = model.load_lora(path if resumed is None else resumed[0] / "adapter.gguf")
    ctx = Context(model, n_ctx=ctx_size, n_batch=ctx_size, n_ubatch=ctx_size, n_threads=n_threads, training=True)
    run.ctx = ctx
    saved = [-1]

    def save() -> None:
        if checkpoint_dir is None or result.steps in (0, saved[0]):
            return
        state = dict(run_id, step=result.steps, total=total, losses=result.losses)
        weights = model if result.adapter is None else result.adapter
        result.checkpoints.append(save_checkpoint(checkpoint_dir, ctx, weights, state))
        saved[0] = result.steps

    run.save = save
    try:
        if log is not None:
            run.log = open(log, "a", encoding="utf-8")  # noqa: SIM115 (closed in finally)
        if result.adapter is not None:
            ctx.set_lora(result.adapter, 1.0)
        ctx.opt_init(optimizer, lr, weight_decay, "lora" if lora else "model", grad_accum=batch_size)
        result.val_loss_before = _validate(ctx, val_win, val_lab)[0]
        if resumed is not None:
            if not len(val_win):  # ggml-opt allocates AdamW's moments with its first graph
                ctx.opt_step(win[0], train=False, labels=None if lab is None else lab[0])
            restore_optimizer(ctx, *resumed)
            result.steps = saved[0] = int(resumed[1]["step"])
            result.losses = [float(x) for x in resumed[1]["losses"]]
        run.t_start = time.perf_counter()  # tokens/s and the ETA count this run's training steps from here
        run.first_step = result.steps
        first_epoch, skip = divmod(result.steps, n_batches)
        for epoch in range(epochs):
            order = rng.permutation(n_train) if shuffle else np.arange(n_train)
            if epoch < first_epoch:  # resumed: the same permutations as the run that saved
                continue
            batches = np.resize(order, n_batches * batch_size).reshape(-1, batch_size)
            if epoch == first_epoch:
                batches = batches[skip:]
            if iters is not None:
                batches = batches[: iters - result.steps]
            stats = _epoch(run, batches, epoch, result)
            if stats is not None:
                result.epochs.append(stats)
            if result.interrupted:
                break
        save()
    finally:
        ctx.close()
        if run.log is not None:
            run.log.close()
    return result


@dataclass
class _Run:
    """What one finetune call's epochs share."""

    ctx: Any
    train: tuple[np.ndarray, np.ndarray | None]
    val: tuple[np.ndarray, np.ndarray | None]
    total: int
    epochs: int
    progress: bool
    on_step: Callable[[int, float], Any] | None
    lr: Callable[[int], float]
    eval_every: int | None
    report_every: int | None
    log: IO[str] | None
    save_every: int | None = None
    save: Callable[[], None] | None = None
    t_start: float = field(default_factory=time.perf_counter)
    first_step: int = 0
    n_tok: int = 0

    def write(self, **row: Any) -> None:
        if self.log is not None:
            self.log.write(json.dumps(row) + "\n")
            self.log.flush()


def _epoch(run: _Run, batches: np.ndarray, epoch: int, result: TrainResult) -> EpochStats | None:
    """One pass over ``batches`` (rows of train window indices, one optimizer step each)."""
    ctx, (train_w, train_l) = run.ctx, run.train
    bar = None
    if run.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(batches), desc=f"epoch {epoch + 1}/{run.epochs}", unit="step", leave=False)
    t0, n_tok, losses, accs, val_seconds = time.perf_counter(), 0, [], [], 0.0
    try:
        for batch in batches:
            lr = run.lr(result.steps)
            ctx.opt_set_lr(lr)
            ctx.opt_reset()
            for i in batch:
                ctx.opt_step(train_w[i], train=True, labels=None if train_l is None else train_l[i])
            loss, acc, n = ctx.opt_result(train=True)
            result.steps += 1
            if not math.isfinite(loss):
                raise FloatingPointError(f"the training loss is {loss} at step {result.steps} (epoch {epoch + 1})")
            losses.append(loss)
            accs.append(acc)
            result.losses.append(loss)
            n_tok += len(batch) * (train_w.shape[1] - 1)
            run.n_tok += len(batch) * (train_w.shape[1] - 1)
            elapsed = time.perf_counter() - run.t_start
            tok_s = run.n_tok / elapsed
            run.write(step=result.steps, epoch=epoch + 1, loss=loss, lr=lr, tokens=run.n_tok, tokens_per_s=tok_s,
                      seconds=elapsed)  # fmt: skip
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:.1f}")
                bar.update(1)
            if run.report_every and result.steps % run.report_every == 0:
                eta = elapsed / (result.steps - run.first_step) * (run.total - result.steps)
                line = f"step {result.steps}/{run.total}: loss {loss:.4f}, lr {lr:.3g}, {tok_s:.1f} tokens/s"
                print(f"{line}, ETA {eta:.0f} s", file=sys.stderr, flush=True)
            if run.eval_every and result.steps % run.eval_every == 0 and len(run.val[0]):
                t1 = time.perf_counter()
                vl, va = _validate(ctx, *run.val)
                val_seconds += time.perf_counter() - t1
                result.evals.append((result.steps, vl))
                run.write(step=result.steps, val_loss=vl, val_accuracy=va)
                if run.report_every:
                    print(f"step {result.steps}: validation loss {vl:.4f}", file=sys.stderr, flush=True)
            if run.save_every and result.steps % run.save_every == 0 and run.save is not None:
                run.save()
            if run.on_step is not None:
                run.on_step(result.steps, loss)
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0 - val_seconds
    if not losses:
        return None
    t1 = time.perf_counter()
    val_loss, val_acc = _validate(ctx, *run.val) if not result.interrupted else (math.nan, math.nan)
    if not result.interrupted and len(run.val[0]):
        run.write(step=result.steps, val_loss=val_loss, val_accuracy=val_acc)
    return EpochStats(
        epoch + 1,
        float(np.mean(losses)),
        val_loss,
        float(np.mean(accs)),
        val_acc,
        n_tok / seconds,
        seconds,
        time.perf_counter() - t1 + val_seconds,
    )


def _validate(ctx: Context, val_w: np.ndarray, val_l: np.ndarray | None) -> tuple[float, float]:
    """(mean loss per token, accuracy) on the validation windows (forward only); NaN if none."""
    if not len(val_w):
        return math.nan, math.nan
    ctx.opt_reset()
    for i, w in enumerate(val_w):
        ctx.opt_step(w, train=False, labels=None if val_l is None else val_l[i])
    loss, acc, _ = ctx.opt_result(train=False)
    return loss, acc


def _windows(model: Model, data, ctx_size: int, what: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(windows (n, ctx_size + 1), labels (n, ctx_size) or None) of text, token ids or examples."""
    if isinstance(data, str):
        return windows(np.asarray(model.tokenize(data, add_special=True), dtype=np.int64), ctx_size), None
    if isinstance(data, Sequence) and len(data) and all(isinstance(e, Example) for e in data):
        eos = model.token_eos if model.token_eos is not None and model.token_eos >= 0 else 0
        win, lab, _ = example_windows(data, ctx_size, eos)
        return win, lab
    tokens = np.asarray(data)
    if tokens.ndim != 1 or not (np.issubdtype(tokens.dtype, np.integer) or tokens.size == 0):
        raise TypeError(
            f"{what} must be a str, a 1-D sequence of token ids or a list of train.Example; "
            f"got {tokens.dtype} {tokens.shape}"
        )
    if tokens.size and (tokens.min() < 0 or tokens.max() >= model.n_vocab):
        raise ValueError(f"{what}: token ids must be in [0, n_vocab = {model.n_vocab})")
    return windows(tokens, ctx_size), None
