"""Preference tuning (issue 58): DPO (Rafailov et al. 2023, the sigmoid loss) and ORPO (Hong et al. 2024) on
pairs of a chosen and a rejected answer, with LoRA, QLoRA or every weight, in llama.cpp's training graph.

Each pair is two windows of one micro-batch, the prompt and the chosen answer, then the prompt and the rejected
one, each its own sequence (patch 0031); only the answers' tokens are labelled (patch 0027), and the loss is
built from each window's summed log-likelihood in the graph (llama_opt_params.build_loss, patch 0054): one
forward and one backward per micro-batch. DPO's reference log-probabilities are those of the model as the run
starts (a fresh LoRA adapter is zero: the base model, as TRL's reference for peft), computed once by forward
passes of the same graph before the first step (TRL's ``precompute_ref_log_probs``) and kept in checkpoints."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._validate import as_float, expect, one_of
from ..build import devices
from ..model import LoraAdapter, Model
from .args import TrainingArgs, _bool
from .checkpoint import restore_optimizer, save_checkpoint
from .distributed import ProcessGroup, process_group, reports
from .loop import _new_adapter, _resumable, iterate_batches
from .pairs import PreferenceMetrics, PreferencePair, preference_metrics, read_pairs
from .schedule import lr_at
from .trainer import MAX_DOCS, Trainer, check_model

__all__ = ["METHODS", "PreferenceResult", "pack_pairs", "pair_spans", "pair_windows", "preference"]

METHODS = ("dpo", "orpo")
"""The preference losses :func:`preference` trains on."""

_log = logging.getLogger("llamabind")


@dataclass
class PreferenceResult:
    """What :func:`preference` did.

    Attributes:
        adapter: the trained LoRA adapter (None for a full fine-tune).
        steps: optimizer steps taken (counted from the start of a resumed run).
        losses: the loss of each step (nats), DPO's or ORPO's over the step's pairs.
        metrics: each step's :class:`PreferenceMetrics` (TRL's rewards/chosen, rewards/rejected,
            rewards/accuracies, rewards/margins, logps/chosen, logps/rejected) over its pairs.
        val_before: the held-out pairs' metrics before training (None without held-out pairs).
        evals: (step, metrics) of each validation (every ``steps_per_eval`` steps and at the end).
        interrupted: whether Ctrl-C stopped the run (the weights then hold the steps taken).
        checkpoints: the checkpoint directories written.
        truncated: pairs whose prompt or answers were cut to fit a window of ``ctx_size + 1`` tokens.
    """

    adapter: LoraAdapter | None = None
    steps: int = 0
    losses: list[float] = field(default_factory=list)
    metrics: list[PreferenceMetrics] = field(default_factory=list)
    val_before: PreferenceMetrics | None = None
    evals: list[tuple[int, PreferenceMetrics]] = field(default_factory=list)
    interrupted: bool = False
    checkpoints: list[Path] = field(default_factory=list)
    truncated: int = 0


def pair_windows(
    pairs: Sequence[PreferencePair], ctx_size: int, pad: int, *, prompt_labels: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The training windows of ``pairs``: (windows int32 (2n, ctx_size + 1), labels int32 (2n, ctx_size),
    lengths int64 (n, 2), truncated). Window 2i is pair i's prompt then its chosen answer, 2i + 1 the prompt then
    the rejected one, padded with ``pad``; labels are the answer's tokens at the positions that predict them, -1
    elsewhere (``prompt_labels``: the chosen window's prompt tokens after its first too, for ORPO's nll over the
    chosen prompt and answer); lengths the labelled tokens of each answer. A pair longer than the window keeps the
    end of its prompt (at most half the window when the answers need the rest, as TRL's ``keep_end``) and the
    start of its answers; ``truncated`` counts those. Numpy only (no ggml call). Raises ValueError for an answer
    left without a labelled token."""
    n, room = len(pairs), ctx_size + 1
    win = np.full((2 * n, room), pad, np.int32)
    lab = np.full((2 * n, ctx_size), -1, np.int32)
    lengths = np.zeros((n, 2), np.int64)
    truncated = 0
    for i, p in enumerate(pairs):
        prompt, longest = p.prompt, max(len(p.chosen), len(p.rejected))
        if len(prompt) + longest > room:
            truncated += 1
            keep = max(room - longest, min(len(prompt), room // 2))
            prompt = prompt[len(prompt) - keep :]
        for j, answer in enumerate((p.chosen, p.rejected)):
            toks = np.concatenate([prompt, answer[: room - len(prompt)]])
            first = max(len(prompt) - 1, 0)  # the position whose next token is the answer's first
            expect(len(toks) - 1 > first, f"pair {i}: its {('chosen', 'rejected')[j]} answer has no token to learn")
            win[2 * i + j, : len(toks)] = toks
            start = 0 if prompt_labels and j == 0 else first
            lab[2 * i + j, start : len(toks) - 1] = toks[start + 1 :]
            lengths[i, j] = len(toks) - 1 - first
    return win, lab, lengths, truncated


@dataclass
class _Pairs:
    """Pairs as windows, with their answers' lengths, (DPO) reference log-probabilities (n, 2) and (ORPO with
    its nll over the chosen prompt too) the labelled prompt positions of each chosen window (n,)."""

    win: np.ndarray
    lab: np.ndarray
    lengths: np.ndarray
    ref: np.ndarray | None = None
    prompt_rows: np.ndarray | None = None
    pad: int = 0
    spans: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))  # pair_spans: packed micro-batches

    def __len__(self) -> int:
        return len(self.lengths)


def pair_spans(win: np.ndarray, lab: np.ndarray) -> np.ndarray:
    """int64 (n, 3) of :func:`pair_windows`' ``win`` (2n, ctx + 1) and ``lab`` (2n, ctx): per pair, the prompt
    positions its two windows share (before the rejected window's first labelled position, the same tokens in both),
    and the end of each window's labelled positions (chosen, rejected): what :func:`pack_pairs` lays out. Numpy
    only."""
    ctx = lab.shape[1]
    lab_c, lab_r = lab[0::2] >= 0, lab[1::2] >= 0
    same = win[0::2, :ctx] == win[1::2, :ctx]
    differs = np.where(same.all(axis=1), ctx, np.argmin(same, axis=1))
    shared = np.minimum(np.argmax(lab_r, axis=1), differs)
    end_c = ctx - np.argmax(lab_c[:, ::-1], axis=1)
    end_r = ctx - np.argmax(lab_r[:, ::-1], axis=1)
    return np.stack([shared, end_c, end_r], axis=1).reshape(-1, 3).astype(np.int64)


def pack_pairs(
    win: np.ndarray, lab: np.ndarray, spans: np.ndarray, n_ctx: int, pad: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pairs' windows (:func:`pair_windows`: ``win`` (2n, ctx + 1), ``lab`` (2n, ctx)) packed into one window of
    ``n_ctx`` tokens with each prompt once: per pair its shared prompt positions, then the chosen window's
    positions up to its last labelled one, then the rejected one's after the prompt; the chosen answer is document
    2i, the rejected 2i + 1, the prompt a token of both (``spans``: :func:`pair_spans`), the rest of the window
    ``pad`` tokens of the last document, unlabelled. Each answer sees the prompt and itself at the positions of its
    own window, so the loss, its gradient and each answer's log-likelihood are those of the two windows (the
    prefix-sharing layout of Wang et al. 2024). Returns (windows (1, n_ctx + 1), labels (1, n_ctx), segments
    (1, n_ctx), shared (1, n_ctx)) int32 for :meth:`~llamabind.Optimizer.eval`. Numpy only; ValueError when the
    pairs need more than n_ctx tokens."""
    need = int((spans[:, 1] + spans[:, 2] - spans[:, 0]).sum())
    expect(need <= n_ctx, f"{len(spans)} pair(s) need {need} tokens packed; the window holds {n_ctx}")
    tok = np.full(n_ctx + 1, pad, np.int32)
    out = [np.full(n_ctx, -1, np.int32), np.full(n_ctx, 2 * len(spans) - 1, np.int32), np.full(n_ctx, -1, np.int32)]
    at = 0
    for k, (f, end_c, end_r) in enumerate(spans):
        # the prompt (chosen window's, a token of the rejected document too), the chosen answer, the rejected one
        for j, a, b, also in ((0, 0, f, 2 * k + 1), (0, f, end_c, -1), (1, f, end_r, -1)):
            tok[at : at + b - a] = win[2 * k + j, a:b]
            out[0][at : at + b - a] = lab[2 * k + j, a:b]
            out[1][at : at + b - a] = 2 * k + j
            out[2][at : at + b - a] = also
            at += b - a
    return tok[None], out[0][None], out[1][None], out[2][None]


def _as_pairs(model: Model, data, what: str, method: str) -> list[PreferencePair]:
    if isinstance(data, Sequence) and data and all(isinstance(p, PreferencePair) for p in data):
        return list(data)
    try:
        return read_pairs(data, model, name=None if isinstance(data, (str, os.PathLike)) else what, method=method)
    except ValueError as e:
        raise ValueError(e if str(e).startswith(what) else f"{what}: {e}") from None


def _split(
    model: Model, data, valid, a: TrainingArgs, method: str
) -> tuple[list[PreferencePair], list[PreferencePair]]:
    pairs = _as_pairs(model, data, "data", method)
    if valid is not None:
        return pairs, _as_pairs(model, valid, "valid", method)
    n_train = int(len(pairs) * (1.0 - a.val_split))
    expect(n_train >= 1, f"{len(pairs)} pair(s) leave none to train on with val_split={a.val_split}")
    return pairs[:n_train], pairs[n_train:]


def _logps(
    trainer: Trainer, p: _Pairs, idx: np.ndarray, train: bool, refs: np.ndarray | None, pack: int = 0
) -> np.ndarray:
    """float64 (len(idx), 3): the summed log-likelihoods of pairs ``idx``' answers (chosen, rejected) and of
    the chosen window's labelled prompt positions (0 without) from the preference graph, micro-batch by
    micro-batch (train: with the backward pass and the optimizer's steps); a last micro-batch short of pairs is
    filled with copies of the last pair (their values dropped). ``pack``: pairs a micro-batch packed into the
    trainer's one window (:func:`pack_pairs`); 0: a window a sequence."""
    opt, m = trainer.optimizer, pack or trainer.micro_batch // 2
    n = len(idx)
    fill = idx[-1:] if not pack else np.array([np.argmin(_packed_lengths(p.spans))])  # the shortest: _packed_ctx's
    full = np.concatenate([idx, np.repeat(fill, -n % m)])
    rows = np.stack([2 * full, 2 * full + 1], axis=1).reshape(-1)
    ref = np.zeros(len(full)) if refs is None else np.concatenate([refs, np.repeat(refs[-1:], -n % m)])
    out = []
    opt.reset()
    for k in range(0, len(full), m):
        r = rows[2 * k : 2 * (k + m)]
        prompt_rows = None if p.prompt_rows is None else p.prompt_rows[full[k : k + m]]
        if pack:
            win, lab, seg, shared = pack_pairs(p.win[r], p.lab[r], p.spans[full[k : k + m]], trainer.ctx_size, p.pad)
            opt.eval(win, train, lab, ref[k : k + m], prompt_rows, segments=seg, shared=shared)
        else:
            opt.eval(p.win[r], train, p.lab[r], ref[k : k + m], prompt_rows)
        answers = opt.seq_logps().reshape(-1, 2)
        out.append(np.concatenate([answers, opt.seq_logps(prompt=True)[0::2, None]], axis=1))
    return np.concatenate(out)[:n]


def _metrics(p: _Pairs, idx: np.ndarray, logps: np.ndarray, method: str, beta: float) -> PreferenceMetrics:
    """The metrics of pairs ``idx`` from :func:`_logps`' values; ORPO's nll over the labelled tokens of the
    chosen windows (with ``prompt_rows``: the prompt's too, TRL's)."""
    nll = None
    if method == "orpo" and p.prompt_rows is not None:
        nll = -(logps[:, 0].sum() + logps[:, 2].sum()) / (p.lengths[idx, 0].sum() + p.prompt_rows[idx].sum())
    return preference_metrics(
        logps[:, :2], None if p.ref is None else p.ref[idx], method=method, beta=beta, lengths=p.lengths[idx], nll=nll
    )


@dataclass
class _PrefRun:
    """What one preference call's steps share."""

    trainer: Trainer
    train: _Pairs
    val: _Pairs
    method: str
    beta: float
    a: TrainingArgs
    total: int
    result: PreferenceResult
    run_id: dict
    log: Any = None
    saved: int = -1
    pack: int = 0  # pairs a micro-batch packed into one window (TrainingArgs.pack); 0: a window a sequence
    group: ProcessGroup | None = None  # a data-parallel run's: rank 0 logs, reports and writes checkpoints

    @property
    def main(self) -> bool:
        """Whether this process reports (:func:`~llamabind.train.distributed.reports`)."""
        return reports(self.group)

    def write(self, **row: Any) -> None:
        if self.log is not None:
            self.log.write(json.dumps(row) + "\n")
            self.log.flush()

    def validate(self) -> PreferenceMetrics:
        """The held-out pairs' metrics (forward passes), written to the log; there must be held-out pairs."""
        idx = np.arange(len(self.val))
        refs = None if self.val.ref is None else self.val.ref[:, 0] - self.val.ref[:, 1]
        m = _metrics(self.val, idx, _logps(self.trainer, self.val, idx, False, refs, self.pack), self.method, self.beta)
        self.write(step=self.result.steps, **{f"eval_{k}": v for k, v in _trl_names(m).items()})
        return m

    def step(self, batch: np.ndarray, lr: float) -> PreferenceMetrics:
        """One optimizer step over pairs ``batch`` (a data-parallel run: this rank's share, ``batch[rank::world]``,
        its gradients averaged over the ranks before the step) and the metrics of all of them."""
        self.trainer.set_lr(lr)
        g = self.group
        rows = batch if g is None else g.shard(batch)
        refs = None if self.train.ref is None else self.train.ref[rows, 0] - self.train.ref[rows, 1]
        logps = _logps(self.trainer, self.train, rows, True, refs, self.pack)
        if g is not None:  # every rank's pairs' values in the batch's order, for the metrics of the whole batch
            logps = g.gather_rows(logps, interleaved=True)
        return _metrics(self.train, batch, logps, self.method, self.beta)

    def checkpoint(self) -> None:
        r = self.result
        if self.a.checkpoint_dir is None or r.steps in (0, self.saved) or not self.main:
            return
        state = dict(self.run_id, step=r.steps, total=self.total, losses=r.losses)
        if self.train.ref is not None and self.val.ref is not None:  # the reference stays the run's first model
            state["reference"] = {"train": self.train.ref.tolist(), "valid": self.val.ref.tolist()}
        weights = self.trainer.context.model if r.adapter is None else r.adapter
        r.checkpoints.append(save_checkpoint(self.a.checkpoint_dir, self.trainer, weights, state))
        self.saved = r.steps


def _trl_names(m: PreferenceMetrics) -> dict[str, float]:
    """The metrics under the names TRL logs them by."""
    return {
        "loss": m.loss, "rewards/chosen": m.rewards_chosen, "rewards/rejected": m.rewards_rejected,
        "rewards/accuracies": m.rewards_accuracies, "rewards/margins": m.rewards_margins,
        "logps/chosen": m.logps_chosen, "logps/rejected": m.logps_rejected,
    }  # fmt: skip


def preference(
    model: Model,
    data: str | os.PathLike | Sequence[dict] | Sequence[PreferencePair] | Any,
    args: TrainingArgs | None = None,
    *,
    method: str = "dpo",
    beta: float = 0.1,
    prompt_loss: bool = True,
    valid: Any = None,
    on_step: Callable[[int, PreferenceMetrics], Any] | None = None,
    resume: str | os.PathLike | None = None,
    **settings: Any,
) -> PreferenceResult:
    """Preference-tune ``model`` on pairs of a chosen and a rejected answer: DPO's sigmoid loss or ORPO's,
    every weight (F32, loaded with use_mmap=False) or with ``lora_rank`` a new LoRA adapter over the frozen
    model (any weight type, repack=False: QLoRA). TRL's DPOTrainer / ORPOTrainer are what it follows.

    Args:
        model: the :class:`~llamabind.Model` to train; its weights (or the adapter's) change in place.
        data: the pairs: a JSONL file, a list of dicts or a 🤗 Dataset in TRL's preference formats
            (:func:`read_pairs`: ``{"prompt", "chosen", "rejected"}`` as text or lists of messages), or
            a list of :class:`PreferencePair`.
        args: the run's settings, a :class:`~llamabind.train.TrainingArgs` (or its fields as keyword
            arguments, ``settings``): ``batch_size`` counts pairs (two windows each: a micro-batch of
            ``batch_size // grad_accum`` pairs is one graph), ``ctx_size`` is each window's tokens (a
            longer pair is cut: :func:`pair_windows`), ``val_split`` holds back the last pairs; ``pack``
            puts a micro-batch's pairs into one window with each prompt once (:func:`pack_pairs`: the same
            losses; None: where the output layer runs on a CUDA GPU with flash attention); the schedule, LoRA,
            precision, flash attention, checkpoints and reports as :func:`finetune`. Under a torchrun launch
            (data-parallel, :mod:`~llamabind.train.distributed`): ``batch_size`` pairs a rank, each step's
            gradients averaged over the ranks, its metrics over all its pairs; rank 0 logs and checkpoints.
        method: ``"dpo"`` (Rafailov et al. 2023, eq. 7: ``-log sigmoid(beta ((log pi(c) - log ref(c)) -
            (log pi(r) - log ref(r))))``, the log-probabilities summed over each answer's tokens, the mean over
            the pairs; TRL's DPOTrainer, ``loss_type="sigmoid"``) or ``"orpo"`` (Hong et al. 2024, eq. 6-7:
            the chosen sequences' mean token nll plus ``beta`` x the mean over the pairs of ``-log sigmoid`` of
            the log odds ratio of the answers' mean token log-probabilities; no reference; TRL's
            ORPOTrainer). The pairs are tokenized as that trainer does (:func:`read_pairs`).
        beta: DPO's beta or ORPO's lambda, > 0 (TRL's defaults: 0.1 for both).
        prompt_loss: ORPO's nll covers the chosen prompt's tokens (after its first) and the chosen answer's,
            pooled over the batch, as TRL's ORPOTrainer and the ORPO authors' code by default; False: the
            chosen answers' tokens only (the authors' ``disable_prompt_loss``). DPO ignores it.
        valid: held-out pairs of the same kinds, instead of ``val_split``.
        on_step: called as on_step(step, metrics) after each optimizer step.
        resume: a checkpoint (or a checkpoint_dir: its newest) of the same run to continue from (the
            reference log-probabilities come from it); ValueError naming what differs.

    Returns a :class:`PreferenceResult` (per-step losses and TRL's reward metrics, the held-out metrics
    before and during training, the adapter). Ctrl-C stops between steps and returns what was trained.
    Wraps llama_opt_init / llama_opt_epoch with llama_opt_params.build_loss (patch 0054).

    Raises TypeError/ValueError for bad settings (naming the field), a method other than "dpo" or "orpo",
    beta <= 0, bad pairs (naming the file, line and field: nothing trains), fewer pairs than batch_size, a
    model training cannot use (:func:`~llamabind.train.Trainer`); FloatingPointError naming the step if the
    loss becomes NaN/inf.
    """
    method = one_of(method, "method", METHODS)
    beta = as_float(beta, "beta")
    expect(beta > 0 and math.isfinite(beta), f"beta must be a finite number > 0; got {beta}")
    a = TrainingArgs.of(args, **settings)
    check_model(model, a.lora)
    prompt_loss = method == "orpo" and _bool(prompt_loss, "prompt_loss")
    train_pairs, val_pairs = _split(model, data, valid, a, method)
    n_train = len(train_pairs)
    group = process_group(a.ddp_backend, a.ddp_timeout, gpu=bool(model.output_offloaded))
    batch = a.batch_size * (group.world_size if group else 1)  # pairs a step: batch_size a rank
    ranks = f" x {group.world_size} ranks" if group else ""
    expect(batch <= n_train, f"batch_size {a.batch_size}{ranks} is larger than the {n_train} training pair(s)")
    sets, truncated = _pair_sets(model, train_pairs, val_pairs, a.ctx_size, prompt_loss)
    result = PreferenceResult(truncated=truncated)
    n_batches = -(-n_train // batch)
    total = a.iters if a.iters is not None else a.epochs * n_batches
    epochs = a.epochs if a.iters is None else -(-a.iters // n_batches)
    run_id = _run_id(a, n_train, method, beta, prompt_loss, batch)
    resumed = None if resume is None else _resumable(resume, run_id, total, model, a)
    if a.lora:
        result.adapter = _new_adapter(model, a) if resumed is None else model.load_lora(resumed[0] / "adapter.gguf")
    trainer, pack = _trainer(model, a, sets, result.adapter, method, beta, group)
    run = _PrefRun(trainer, sets[0], sets[1], method, beta, a, total, result, run_id, pack=pack, group=group)
    try:
        if a.log is not None and run.main:
            run.log = open(a.log, "a", encoding="utf-8")  # noqa: SIM115 (closed in finally)
        if method == "dpo":
            _set_reference(run, resumed)
        result.val_before = run.validate() if len(run.val) else None
        if resumed is not None:
            if not len(run.val):  # ggml-opt allocates AdamW's moments with its first graph
                zero = None if run.train.ref is None else np.zeros(1)
                _logps(trainer, run.train, np.arange(1), False, zero, run.pack)
            restore_optimizer(trainer, *resumed)
            result.steps = run.saved = int(resumed[1]["step"])
            result.losses = [float(x) for x in resumed[1]["losses"]]
        _loop(run, epochs, on_step)
        run.checkpoint()
    finally:
        trainer.close()
        if run.log is not None:
            run.log.close()
    return result


def _trainer(
    model: Model,
    a: TrainingArgs,
    sets: Sequence[_Pairs],
    adapter: LoraAdapter | None,
    method: str,
    beta: float,
    group: ProcessGroup | None,
) -> tuple[Trainer, int]:
    """The run's Trainer and how many pairs a micro-batch packs into its one window (0: a window a sequence)."""
    # pack: a micro-batch's pairs in one window, each prompt once (pack_pairs), the window fitted to the longest
    packed = a.pack if a.pack is not None else _packs_where_it_pays(model, a)
    pack = a.batch_size // a.grad_accum if packed else 0
    expect(2 * pack <= MAX_DOCS, f"pack: at most {MAX_DOCS // 2} pairs a micro-batch; got {pack}")
    targs = (
        a.replace(batch_size=a.grad_accum, ctx_size=_packed_ctx(sets, pack), pack=True)
        if pack
        else a.replace(batch_size=2 * a.batch_size, pack=False)
    )
    trainer = Trainer(
        model, targs, params="lora" if a.lora else "model", adapter=adapter, loss=method, beta=beta, group=group
    )  # fmt: skip
    if method == "dpo" and model.output_offloaded:
        # DPO's reference log-probabilities and the validations from the training graph's forward pass, as the policy's
        # at step 1 (patch 0095): a GPU's forward graph alone fuses and rounds otherwise (an H200's first loss was
        # 0.7067, not ln 2); on the CPU the two are the same sums already
        trainer.optimizer.forward_as_training(True)
    return trainer, pack


def _run_id(a: TrainingArgs, n_train: int, method: str, beta: float, prompt_loss: bool, batch: int) -> dict:
    """What a checkpoint of the run records, for a resumed run to match (``batch``: the pairs a step, over the
    ranks of a data-parallel run)."""
    return dict(
        kind="lora" if a.lora else "full", ctx_size=a.ctx_size, n_train=n_train, batch_size=batch,
        seed=a.seed, shuffle=a.shuffle, optimizer=a.optimizer, embeddings=a.train_embeddings and not a.lora,
        lora=None if not a.lora else dict(rank=a.lora_rank, alpha=a.lora_alpha, targets=list(a.lora_targets)),
        method=method, beta=beta, **({"prompt_loss": prompt_loss} if method == "orpo" else {}),
    )  # fmt: skip


def _pair_sets(model: Model, train_pairs, val_pairs, ctx_size: int, prompt_loss: bool) -> tuple[list[_Pairs], int]:
    """The train and held-out pairs as windows (:func:`pair_windows`; ``prompt_loss``: the chosen prompts
    labelled too, with their labelled positions counted), and how many pairs were cut to fit."""
    pad = model.token_eos if model.token_eos is not None and model.token_eos >= 0 else 0
    sets, truncated = [], 0
    for what, pairs in (("data", train_pairs), ("valid", val_pairs)):
        try:
            *arrays, cut = (
                pair_windows(pairs, ctx_size, pad, prompt_labels=prompt_loss) if pairs else (*_empty(ctx_size), 0)
            )
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
        win, lab, lengths = arrays
        p = _Pairs(win, lab, lengths, pad=pad)
        p.spans = pair_spans(p.win, p.lab)
        if prompt_loss:
            p.prompt_rows = ((p.lab[0::2] >= 0).sum(axis=1) - p.lengths[:, 0]).astype(np.int32)
        sets.append(p)
        truncated += cut
    if truncated:
        _log.warning("%d preference pair(s) cut to fit ctx_size %d", truncated, ctx_size)
    return sets, truncated


def _packs_where_it_pays(model: Model, a: TrainingArgs) -> bool:
    """TrainingArgs.pack=None for pairs: packed where the output layer runs on a CUDA GPU with flash attention (the
    training kernels skip the tiles of other pairs); elsewhere the attention would span the whole packed window."""
    cuda = any(d.get("type") == "gpu" and d.get("backend") == "CUDA" for d in devices())
    return bool(model.output_offloaded) and a.flash_attn is not False and cuda


def _packed_lengths(spans: np.ndarray) -> np.ndarray:
    """The tokens each pair takes packed (:func:`pack_pairs`): its prompt once and its two answers."""
    return spans[:, 1] + spans[:, 2] - spans[:, 0]


def _packed_ctx(sets: Sequence[_Pairs], pack: int) -> int:
    """The window (a multiple of 256) that holds any ``pack`` pairs of ``sets`` packed: the longest ones, or all of a
    set with fewer and copies of its shortest (what :func:`_logps` fills a short micro-batch with)."""
    need = 1
    for p in sets:
        if len(p):
            n = np.sort(_packed_lengths(p.spans))[::-1]
            need = max(need, int(n[:pack].sum() + max(pack - len(n), 0) * n[-1]))
    return -(-need // 256) * 256


def _empty(ctx_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros((0, ctx_size + 1), np.int32), np.zeros((0, ctx_size), np.int32), np.zeros((0, 2), np.int64)


def _set_reference(run: _PrefRun, resumed: tuple[Path, dict] | None) -> None:
    """DPO's reference log-probabilities: the resumed run's, or forward passes of the model as it starts."""
    if resumed is not None:
        ref = resumed[1].get("reference") or {}
        run.train.ref = np.asarray(ref.get("train", []), np.float64).reshape(-1, 2)
        run.val.ref = np.asarray(ref.get("valid", []), np.float64).reshape(-1, 2)
        expect(
            len(run.train.ref) == len(run.train) and len(run.val.ref) == len(run.val),
            f"{resumed[0]}: its reference log-probabilities are not of these pairs",
        )
        return
    for p in (run.train, run.val):
        p.ref = _logps(run.trainer, p, np.arange(len(p)), False, None, run.pack)[:, :2] if len(p) else np.zeros((0, 2))


def _loop(run: _PrefRun, epochs: int, on_step: Callable[[int, PreferenceMetrics], Any] | None) -> None:
    """The optimizer steps, reports, validations and checkpoints of the run."""
    a, r = run.a, run.result
    t0, first, n_tok = time.perf_counter(), r.steps, 0
    try:
        batch_size = a.batch_size * (run.group.world_size if run.group else 1)
        for epoch, batches in iterate_batches(len(run.train), batch_size, epochs, a.seed, a.shuffle, r.steps, a.iters):
            for batch in batches:
                lr = lr_at(r.steps, run.total, a.lr, a.lr_schedule, a.warmup, a.min_lr)
                m = run.step(batch, lr)
                r.steps += 1
                if not math.isfinite(m.loss):
                    raise FloatingPointError(f"the {run.method} loss is {m.loss} at step {r.steps} (epoch {epoch + 1})")
                r.losses.append(m.loss)
                r.metrics.append(m)
                n_tok += 2 * len(batch) * a.ctx_size
                tok_s = n_tok / (time.perf_counter() - t0)
                norm = {"grad_norm": run.trainer.optimizer.grad_norm()} if a.max_grad_norm else {}
                run.write(step=r.steps, epoch=epoch + 1, lr=lr, tokens_per_s=tok_s, **_trl_names(m), **norm)
                if a.steps_per_report and r.steps % a.steps_per_report == 0 and run.main:
                    print(
                        f"step {r.steps}/{run.total}: loss {m.loss:.4f}, margin {m.rewards_margins:.4f}, "
                        f"accuracy {m.rewards_accuracies:.2f}, lr {lr:.3g}, {tok_s:.1f} tokens/s",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip
                if a.steps_per_eval and r.steps % a.steps_per_eval == 0 and len(run.val):
                    r.evals.append((r.steps, run.validate()))
                if a.save_every and r.steps % a.save_every == 0:
                    run.checkpoint()
                if on_step is not None:
                    on_step(r.steps, m)
    except KeyboardInterrupt:
        r.interrupted = True
    if r.steps > first and len(run.val) and not r.interrupted and (not r.evals or r.evals[-1][0] != r.steps):
        r.evals.append((r.steps, run.validate()))
