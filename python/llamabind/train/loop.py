"""The training loop, as mlx-lm's tuner/trainer.py reads: batches of windows -> an optimizer step
(:class:`~llamabind.train.trainer.Trainer`) -> validation -> report and checkpoint."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..model import LoraAdapter, Model
from .args import TrainingArgs
from .checkpoint import check_matches, load_state, restore_optimizer, save_checkpoint
from .data import Example, example_windows, from_dataset, is_dataset, is_stream, packed_windows, windows
from .distributed import ProcessGroup, process_group, reports
from .lora import lora_init
from .schedule import lr_at
from .trainer import MAX_DOCS, Trainer, check_model

__all__ = ["EpochStats", "TrainResult", "finetune"]


@dataclass
class EpochStats:
    """One epoch's statistics.

    epoch: its index from 0. train_loss, val_loss: mean next-token cross-entropy per counted token
    (nats) on the train and validation windows; train_accuracy, val_accuracy: next-token accuracy
    (argmax); tokens_per_s: training throughput; seconds, val_seconds: wall time of the training
    steps and of the validation."""

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
    """What :func:`finetune` did.

    epochs: per-epoch :class:`EpochStats`; adapter: the trained LoRA adapter (None for a full
    fine-tune); val_loss_before: the validation loss before training (nan without validation);
    steps: optimizer steps taken; losses: the per-step train losses; interrupted: whether Ctrl-C
    stopped it early (the weights then hold the steps taken); evals: the validations (step, loss)
    in between; checkpoints: the checkpoint directories written. ``steps`` and ``losses`` count from
    the start of the run a checkpoint resumed."""

    epochs: list[EpochStats] = field(default_factory=list)
    adapter: LoraAdapter | None = None
    val_loss_before: float = math.nan
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    interrupted: bool = False
    evals: list[tuple[int, float]] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)


def finetune(
    model: Model,
    data: str | Sequence[int] | Sequence[Example],
    args: TrainingArgs | None = None,
    *,
    valid: str | Sequence[int] | Sequence[Example] | None = None,
    on_step: Callable[[int, float], Any] | None = None,
    resume: str | os.PathLike | None = None,
    **settings: Any,
) -> TrainResult:
    """Fine-tune ``model`` on ``data``: every weight (F32, loaded with use_mmap=False), or with
    ``lora_rank`` a new LoRA adapter over the frozen model (any weight type; repack=False).

    Args:
        model: the :class:`~llamabind.Model` to train: F32 weights loaded with use_mmap=False for a
            full fine-tune; any weights loaded with repack=False for LoRA. Its weights change in place.
        data: text (tokenized with the model's tokenizer, BOS added; windows of ``ctx_size + 1``
            tokens every ``ctx_size // 2``), token ids, shape (n,), any integer dtype, each in
            [0, n_vocab), a list of :class:`Example` (e.g. from :func:`load_jsonl`: one per window,
            cut or padded, the loss on their counted tokens only), or a 🤗 ``Dataset``/``IterableDataset``
            with a ``text``, ``prompt``/``completion`` or ``messages`` column (:func:`from_dataset`).
        args: the run's settings, a :class:`~llamabind.train.TrainingArgs` (ctx_size, batch_size,
            lr, schedule, LoRA rank/alpha/targets, precision, flash attention, checkpoints, ...);
            its fields may be given as keyword arguments instead or on top (``settings``). An
            epoch's last batch is filled up with windows from the start of its order, so every train
            window counts at least once per epoch. A LoRA adapter is made by :func:`lora_init` with
            ``seed`` and returned as ``result.adapter``. Checkpoints (the adapter or the model,
            AdamW's moments and step counter, the run's position) go to
            ``checkpoint_dir/step-NNNNNNN/`` every ``save_every`` steps, at the end, and when Ctrl-C
            stops the run; all are kept (a full fine-tune's is 3x the F32 model's size).
        valid: held-out data of the same kinds for the validation loss, instead of ``val_split``.
            A streamed dataset (an ``IterableDataset``) as data is read for ``iters`` steps (required)
            and its held-out share; as valid, for its first 25 batches (mlx-lm's ``--val-batches``).
        on_step: called as on_step(step, loss) after each optimizer step.
        resume: a checkpoint (or a checkpoint_dir: its newest) to continue from, to the same
            weights as the uninterrupted run: same data, ctx_size, batch_size, seed, shuffle,
            optimizer, embeddings and LoRA rank/alpha/targets (ValueError naming what differs);
            the steps continue from the checkpoint's (``iters`` and the schedule count the whole
            run). A LoRA run loads the checkpoint's adapter; a full fine-tune must be given the
            model loaded from its ``model.gguf``.

    Returns a :class:`TrainResult`. Ctrl-C stops between steps and returns what was trained
    (``interrupted``: True); the model stays usable.

    Raises TypeError/ValueError for bad settings (:meth:`TrainingArgs.checked`: naming the field),
    data shorter than one window, a full fine-tune of a model that is not F32 or is memory-mapped;
    FloatingPointError naming the step if the loss becomes NaN/inf.
    """
    a = TrainingArgs.of(args, **settings)
    check_model(model, a.lora)
    train_set, val_set = _split(model, data, valid, a)
    n_train = len(train_set[0])
    group = process_group(a.ddp_backend, a.ddp_timeout, gpu=bool(model.output_offloaded))
    batch = _global_batch(a, group, n_train, len(val_set[0]))
    n_batches = -(-n_train // batch)
    epochs = a.epochs if a.iters is None else -(-a.iters // n_batches)
    total = a.iters if a.iters is not None else epochs * n_batches
    run_id = dict(
        kind="lora" if a.lora else "full", ctx_size=a.ctx_size, n_train=n_train, batch_size=batch,
        seed=a.seed, shuffle=a.shuffle, optimizer=a.optimizer, embeddings=a.train_embeddings and not a.lora,
        **({"pack": True} if a.pack else {}),
        lora=None if not a.lora else dict(rank=a.lora_rank, alpha=a.lora_alpha, targets=list(a.lora_targets)),
    )  # fmt: skip
    resumed = None if resume is None else _resumable(resume, run_id, total, model, a)
    result = TrainResult()
    if a.lora:
        result.adapter = _new_adapter(model, a) if resumed is None else model.load_lora(resumed[0] / "adapter.gguf")
    trainer = Trainer(model, a, params="lora" if a.lora else "model", adapter=result.adapter, group=group)
    run = _Run(
        trainer=trainer, train=train_set, val=val_set, total=total, epochs=epochs, progress=a.progress,
        on_step=on_step, lr=lambda step: lr_at(step, total, a.lr, a.lr_schedule, a.warmup, a.min_lr),
        eval_every=a.steps_per_eval, report_every=a.steps_per_report, save_every=a.save_every, result=result,
        checkpoint_dir=a.checkpoint_dir, run_id=run_id, group=group,
    )  # fmt: skip
    try:
        if a.log is not None and run.main:
            run.log = open(a.log, "a", encoding="utf-8")  # noqa: SIM115 (closed in finally)
        result.val_loss_before = _loss_before(run, a.progress)
        if resumed is not None:
            if not len(val_set[0]):  # ggml-opt allocates AdamW's moments with its first graph
                trainer.evaluate(*_take(train_set, [0]))
            restore_optimizer(trainer, *resumed)
            result.steps = run.saved = int(resumed[1]["step"])
            result.losses = [float(x) for x in resumed[1]["losses"]]
        run.t_start = time.perf_counter()  # tokens/s and the ETA count this run's training steps from here
        run.first_step = result.steps
        for epoch, batches in iterate_batches(n_train, batch, epochs, a.seed, a.shuffle, result.steps, a.iters):
            stats = _epoch(run, batches, epoch)
            if stats is not None:
                result.epochs.append(stats)
            if result.interrupted:
                break
        run.checkpoint()
    finally:
        trainer.close()
        if run.log is not None:
            run.log.close()
    return result


def _global_batch(a: TrainingArgs, group: ProcessGroup | None, n_train: int, n_val: int) -> int:
    """The windows a step takes: batch_size, times the ranks of a data-parallel run. ValueError over ``n_train`` (as
    mlx-lm: each step would repeat windows to fill the batch), and for steps_per_eval without validation windows."""
    batch = a.batch_size * (group.world_size if group else 1)
    if batch > n_train:
        raise ValueError(
            f"batch_size {a.batch_size}{f' x {group.world_size} ranks' if group else ''} is larger than the {n_train} "
            "training window(s): give more data or a smaller batch_size"
        )
    if a.steps_per_eval is not None and not n_val:
        raise ValueError(
            "steps_per_eval needs validation windows: give valid= or a val_split that holds some back "
            f"(val_split={a.val_split} left none of {n_train})"
        )
    return batch


def _resumable(resume, run_id: dict, total: int, model: Model, a: TrainingArgs) -> tuple[Path, dict]:
    """(checkpoint, its state) to resume this run from: the same run (check_matches), a step left to
    take, and for a full fine-tune the model loaded from the checkpoint. ValueError naming what differs."""
    ckpt, state = load_state(resume)
    check_matches(state, run_id, ckpt)
    if int(state["step"]) >= total:
        raise ValueError(
            f"{ckpt} is at step {state['step']}; this run has {total} steps in all: nothing to resume (give a "
            "larger iters or more epochs)"
        )
    if not a.lora and Path(model.path).resolve() != (ckpt / "model.gguf").resolve():
        raise ValueError(
            f"resuming a full fine-tune: load the model from the checkpoint, "
            f"Model({str(ckpt / 'model.gguf')!r}, use_mmap=False); got {model.path}"
        )
    return ckpt, state


def _new_adapter(model: Model, a: TrainingArgs) -> LoraAdapter:
    """A new LoRA adapter of the run's rank, alpha and targets (lora_init, seeded), loaded on the model."""
    assert a.lora_rank is not None and a.lora_alpha is not None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "lora-init.gguf")
        lora_init(model, path, a.lora_rank, a.lora_alpha, a.lora_targets, a.seed)
        return model.load_lora(path)


def iterate_batches(
    n_train: int, batch_size: int, epochs: int, seed: int, shuffle: bool, start_step: int = 0, iters: int | None = None
):
    """(epoch, batches) per epoch still to run over ``n_train`` train windows for ``epochs`` epochs:
    batches an int array (steps, batch_size) of train window indices, one optimizer step a row. Each
    epoch permutes the windows with the run's seed (in order without ``shuffle``); its last batch is
    filled up from the start of its order. A run resumed at ``start_step`` draws the skipped epochs'
    permutations too, so the order is the uninterrupted run's; ``iters`` cuts the run's steps."""
    rng = np.random.default_rng(seed)
    n_batches = -(-n_train // batch_size)
    first_epoch, skip = divmod(start_step, n_batches)
    step = start_step
    for epoch in range(epochs):
        order = rng.permutation(n_train) if shuffle else np.arange(n_train)
        if epoch < first_epoch:
            continue
        batches = np.resize(order, n_batches * batch_size).reshape(-1, batch_size)
        if epoch == first_epoch:
            batches = batches[skip:]
        if iters is not None:
            batches = batches[: max(0, iters - step)]
        step += len(batches)
        yield epoch, batches


Windows = tuple[np.ndarray, "np.ndarray | None", "np.ndarray | None"]  # tokens, labels, segments


@dataclass
class _Run:
    """What one finetune call's epochs share: the trainer, the data, the schedule, and the report,
    validation and checkpoint settings."""

    trainer: Trainer
    train: Windows
    val: Windows
    total: int
    epochs: int
    progress: bool
    on_step: Callable[[int, float], Any] | None
    lr: Callable[[int], float]
    eval_every: int | None
    report_every: int | None
    save_every: int | None
    result: TrainResult
    checkpoint_dir: str | os.PathLike | None
    run_id: dict
    group: ProcessGroup | None = None  # a data-parallel run's: rank 0 logs, reports and writes checkpoints
    log: IO[str] | None = None
    saved: int = -1
    t_start: float = field(default_factory=time.perf_counter)
    first_step: int = 0
    n_tok: int = 0

    @property
    def main(self) -> bool:
        """Whether this process reports (:func:`~llamabind.train.distributed.reports`)."""
        return reports(self.group)

    def step(self, batch: np.ndarray) -> tuple[float, float]:
        """One optimizer step over the train windows ``batch`` (this rank's share of them in a data-parallel run):
        (loss, accuracy) over all of them, token-weighted."""
        rows = batch if self.group is None else self.group.shard(batch)
        return self._mean(*self.trainer.step(*_take(self.train, rows)))[:2]

    def _mean(self, loss: float, acc: float, n: int) -> tuple[float, float, int]:
        """A rank's (loss, accuracy, tokens) as the token-weighted mean over the ranks."""
        if self.group is None:
            return loss, acc, n
        s = self.group.all_reduce_sum([loss * n if n else 0.0, acc * n if n else 0.0, n])
        return (s[0] / s[2], s[1] / s[2], int(s[2])) if s[2] else (math.nan, math.nan, 0)

    def evaluate(self) -> tuple[float, float]:
        """(loss, accuracy) on the validation windows (each rank its share in a data-parallel run, the sums over
        all); NaN if there are none."""
        val = self.val
        if self.group is not None:
            val = _take(val, slice(self.group.rank, None, self.group.world_size))
        return self._mean(*self.trainer.evaluate(*val))[:2]

    def write(self, **row: Any) -> None:
        if self.log is not None:
            self.log.write(json.dumps(row) + "\n")
            self.log.flush()

    def checkpoint(self) -> None:
        """Write a checkpoint of the steps taken (none twice for one step, none before a step)."""
        r = self.result
        if self.checkpoint_dir is None or r.steps in (0, self.saved) or not self.main:
            return
        state = dict(self.run_id, step=r.steps, total=self.total, losses=r.losses)
        weights = self.trainer.context.model if r.adapter is None else r.adapter
        r.checkpoints.append(save_checkpoint(self.checkpoint_dir, self.trainer, weights, state))
        self.saved = r.steps

    def report(self, epoch: int, loss: float, lr: float, n_tok: int) -> float:
        """The step's JSONL row and stderr line; returns the run's tokens/s."""
        steps = self.result.steps
        self.n_tok += n_tok
        elapsed = time.perf_counter() - self.t_start
        tok_s = self.n_tok / elapsed
        norm = {"grad_norm": self.trainer.optimizer.grad_norm()} if self.trainer.args.max_grad_norm else {}
        self.write(
            step=steps, epoch=epoch + 1, loss=loss, lr=lr, tokens=self.n_tok, tokens_per_s=tok_s, seconds=elapsed,
            **norm,
        )  # fmt: skip
        if self.report_every and steps % self.report_every == 0 and self.main:
            eta = elapsed / (steps - self.first_step) * (self.total - steps)
            line = f"step {steps}/{self.total}: loss {loss:.4f}, lr {lr:.3g}, {tok_s:.1f} tokens/s"
            print(f"{line}, ETA {eta:.0f} s", file=sys.stderr, flush=True)
        return tok_s

    def validate(self) -> tuple[float, float]:
        """(loss, accuracy) on the validation windows, written to the log; NaN if there are none."""
        loss, acc = self.evaluate()
        if len(self.val[0]):
            self.write(step=self.result.steps, val_loss=loss, val_accuracy=acc)
        return loss, acc


def _loss_before(run: _Run, progress: bool) -> float:
    """The validation loss before the first step (NaN without windows); with ``progress``, what the pass is and its
    loss on stderr (it takes a while before the first step's bar appears)."""
    say = progress and len(run.val[0]) > 0 and run.main
    if say:
        print(f"validation before training: {len(run.val[0])} window(s) ...", end="", file=sys.stderr, flush=True)
    loss = run.evaluate()[0]
    if say:
        print(f" loss {loss:.4f}", file=sys.stderr, flush=True)
    return loss


def _epoch(run: _Run, batches: np.ndarray, epoch: int) -> EpochStats | None:
    """One pass over ``batches`` (rows of train window indices, one optimizer step each)."""
    result = run.result
    bar = None
    if run.progress and run.main:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(batches), desc=f"epoch {epoch + 1}/{run.epochs}", unit="step", leave=False)
    t0, n_tok, losses, accs, val_seconds = time.perf_counter(), 0, [], [], 0.0
    try:
        for batch in batches:
            lr = run.lr(result.steps)
            run.trainer.set_lr(lr)
            loss, acc = run.step(batch)
            result.steps += 1
            if not math.isfinite(loss):
                raise FloatingPointError(f"the training loss is {loss} at step {result.steps} (epoch {epoch + 1})")
            losses.append(loss)
            accs.append(acc)
            result.losses.append(loss)
            step_tok = len(batch) * (run.train[0].shape[1] - 1)
            n_tok += step_tok
            tok_s = run.report(epoch, loss, lr, step_tok)
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:.1f}")
                bar.update(1)
            if run.eval_every and result.steps % run.eval_every == 0 and len(run.val[0]):
                t1 = time.perf_counter()
                vl, _ = run.validate()
                val_seconds += time.perf_counter() - t1
                result.evals.append((result.steps, vl))
                if run.report_every:
                    print(f"step {result.steps}: validation loss {vl:.4f}", file=sys.stderr, flush=True)
            if run.save_every and result.steps % run.save_every == 0:
                run.checkpoint()
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
    val_loss, val_acc = run.validate() if not result.interrupted else (math.nan, math.nan)
    return EpochStats(
        epoch + 1, float(np.mean(losses)), val_loss, float(np.mean(accs)), val_acc, n_tok / seconds, seconds,
        time.perf_counter() - t1 + val_seconds,
    )  # fmt: skip


def _take(windows: Windows, idx) -> Windows:
    w, lab, seg = windows
    return w[idx], None if lab is None else lab[idx], None if seg is None else seg[idx]


# the batches of a streamed validation set read (a stream may be endless), as mlx-lm's --val-batches
VALID_STREAM_BATCHES = 25


def _split(model: Model, data, valid, a: TrainingArgs) -> tuple[Windows, Windows]:
    """(train windows, validation windows): ``valid``'s, or the last ``val_split`` of ``data``'s. A
    stream (an ``IterableDataset``, maybe endless) is read for ``iters`` steps and its held-out share
    (without ``iters``: ValueError); a streamed ``valid`` for its first VALID_STREAM_BATCHES batches."""
    limit = None
    if is_stream(data):
        if a.iters is None:
            raise ValueError(
                "data is a streaming dataset (an IterableDataset: its length is not known, it may be endless): "
                "give iters, the optimizer steps to train, and its rows are read for those steps"
            )
        limit = math.ceil(a.iters * a.batch_size / (1.0 - (0.0 if valid is not None else a.val_split))) + 1
    pack = MAX_DOCS // (a.batch_size // a.grad_accum) if a.pack else 0
    win, lab, seg = _windows(model, data, a.ctx_size, "data", limit, pack)
    if valid is not None:
        valid_rows = VALID_STREAM_BATCHES * a.batch_size if is_stream(valid) else None
        return (win, lab, seg), _windows(model, valid, a.ctx_size, "valid", valid_rows, pack)
    n_train = int(len(win) * (1.0 - a.val_split))  # as llama-finetune's idata_split
    if n_train < 1:
        raise ValueError(f"{len(win)} window(s) leave none to train on with val_split={a.val_split}")
    return _take((win, lab, seg), slice(0, n_train)), _take((win, lab, seg), slice(n_train, None))


def _check_not_a_name(text: str, what: str) -> None:
    """A short one-line str that names a file or looks like a Hub dataset id is not training text: it
    trained on its own few tokens ("the data has 10 tokens ..."). ValueError pointing at read_data; for an empty
    string, ValueError saying so (Path("") is the current directory: it was taken for a file's name)."""
    if not text.strip():
        raise ValueError(f"{what} is an empty string: give training text, examples, or train.read_data(path, model)")
    if len(text) > 512 or "\n" in text or " " in text.strip():
        return
    import re

    try:
        exists = Path(text).exists()
    except (OSError, ValueError):  # not a path at all (a NUL byte, too long)
        exists = False
    if exists or re.fullmatch(r"[\w.-]+/[\w.-]+(:[\w.-]+)?", text):
        kind = "a directory" if exists and Path(text).is_dir() else "a file" if exists else "a Hub dataset"
        raise ValueError(
            f"{what} is the string {text!r}, which names {kind}: finetune trains on a str as text; "
            f"read it first: train.read_data({text!r}, model)"
        )


def _windows(model: Model, data, ctx_size: int, what: str, limit: int | None = None, pack: int = 0) -> Windows:
    """(windows (n, ctx_size + 1), labels (n, ctx_size) or None, segments (n, ctx_size) or None) of text,
    token ids, examples or a 🤗 dataset (its rows, the first ``limit`` if given, as examples:
    :func:`~llamabind.train.from_dataset`); ``pack`` > 0: examples packed up to that many a window
    (:func:`~llamabind.train.packed_windows`), ValueError for text or token ids."""
    if is_dataset(data):
        data = from_dataset(data, model, name=f"{what} (a dataset)", limit=limit)
    examples = isinstance(data, Sequence) and len(data) > 0 and all(isinstance(e, Example) for e in data)
    if pack and not examples:
        raise ValueError(
            f"pack: {what} is text or token ids, cut into full windows already; packing is for examples "
            "(train.read_data of a JSONL file, a dataset's rows, a list of train.Example)"
        )
    if isinstance(data, str):
        _check_not_a_name(data, what)
        tokens = np.asarray(model.tokenize(data, add_special=True), dtype=np.int64)
        return _named_windows(tokens, ctx_size, what), None, None
    if isinstance(data, Sequence) and not len(data):
        raise ValueError(f"{what} is empty: no text, token ids or examples to make windows of")
    if examples:
        eos = model.token_eos if model.token_eos is not None and model.token_eos >= 0 else 0
        try:
            if pack:
                win, lab, seg, _ = packed_windows(data, ctx_size, eos, pack)
                return win, lab, seg
            win, lab, _ = example_windows(data, ctx_size, eos)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        return win, lab, None
    tokens = np.asarray(data)
    if tokens.ndim != 1 or not (np.issubdtype(tokens.dtype, np.integer) or tokens.size == 0):
        raise TypeError(
            f"{what} must be a str, a 1-D sequence of token ids or a list of train.Example; "
            f"got {tokens.dtype} {tokens.shape}"
        )
    if tokens.size and (tokens.min() < 0 or tokens.max() >= model.n_vocab):
        raise ValueError(f"{what}: token ids must be in [0, n_vocab = {model.n_vocab})")
    return _named_windows(tokens, ctx_size, what), None, None


def _named_windows(tokens: np.ndarray, ctx_size: int, what: str) -> np.ndarray:
    """:func:`windows`, its error naming the argument (``data`` or ``valid``) the tokens came from."""
    try:
        return windows(tokens, ctx_size)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
