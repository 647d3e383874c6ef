"""A training run's step: :class:`Trainer`, a training context of a micro-batch of windows and
ggml-opt's optimizer over it (:class:`llamabind.optimizer.Optimizer`), one optimizer step a call."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from .._validate import expect, one_of
from ..context import Context
from ..model import LoraAdapter, Model
from ..optimizer import Optimizer
from .args import TrainingArgs
from .distributed import ProcessGroup

__all__ = ["Trainer"]

MAX_DOCS = 256
"""The most documents a packed micro-batch holds (llama.cpp's LLAMA_MAX_SEQ: a packed context's n_seq_max)."""


def check_model(model: Model, lora: bool) -> None:
    """What training needs of ``model``: a causal language model (an encoder such as BERT is refused:
    its first step crashed in llama.cpp), with weights (not vocab_only); for LoRA (``lora``) over a quantized
    model, weights in the GGUF's layout (repack=False); for a full fine-tune, F32 weights loaded with
    use_mmap=False.
    Raises TypeError (not a Model) or ValueError naming the fix; before any llama.cpp call (the
    backward pass over a repacked weight would abort in ggml's scheduler: no backend runs it)."""
    if not isinstance(model, Model):
        raise TypeError(f"model must be a llamabind.Model; got {type(model).__name__}")
    if model.vocab_only:
        raise ValueError("the model was loaded with vocab_only=True: it has no weights to train; load it without")
    meta = model.metadata
    arch = meta.get("general.architecture", "?")
    if meta.get(f"{arch}.attention.causal") is False:  # an encoder (BERT and kin): next-token training means nothing
        raise ValueError(
            f"fine-tuning trains causal language models (next-token prediction); this {arch} model attends in both "
            "directions (an embedding or reranking model): llama.cpp has no training for it"
        )
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


@contextlib.contextmanager
def _bf16_inputs_off(off: bool) -> Iterator[None]:
    """LLAMA_OPT_BF16_INPUTS=0 (patch 0068's BF16 casts of the products' inputs off) for an llama_opt_init in the
    block, where ``off``: a LoRA step with composed attention (flash attention off) on CUDA computes a wrong
    forward pass with them (bench/results/h200-2026-12-04-pref83: -3457 nats for the chosen answers where
    llama_decode gives -3272; right without the casts), a fault in their CUDA path not found yet."""
    if not off:
        yield
        return
    before = os.environ.get("LLAMA_OPT_BF16_INPUTS")
    os.environ["LLAMA_OPT_BF16_INPUTS"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LLAMA_OPT_BF16_INPUTS"]
        else:
            os.environ["LLAMA_OPT_BF16_INPUTS"] = before


class Trainer:
    """A training context of ``batch_size // grad_accum`` windows (the micro-batch: one sequence per
    window, all in one ubatch, so one forward and one backward graph run per micro-batch) and
    ggml-opt's optimizer over it. The graphs are built once and kept while the windows keep their
    shape (patch 0032); an optimizer step takes ``grad_accum`` micro-batches (their gradients
    averaged: patch 0025).

    Args:
        model: the :class:`Model`. Full fine-tuning (``params="model"``) needs F32 weights loaded
            with use_mmap=False; with ``params="lora"`` the model stays frozen.
        args: a :class:`~llamabind.train.TrainingArgs`; its fields may also be given as keyword
            arguments (``settings``). The Trainer reads ctx_size, batch_size, grad_accum, optimizer,
            lr, weight_decay, train_embeddings (with params="model": token_embd too, and a tied
            output matrix with it; patch 0033), precision, flash_attn and n_threads; the loop's
            fields are :func:`~llamabind.train.finetune`'s.
        params: ``"model"`` (every F32 weight) or ``"lora"`` (the A/B tensors of ``adapter``).
        adapter: the LoRA adapter to train (params="lora"), applied at scale 1.
        profile: time every node of the training graphs (:meth:`profile`; slows each step down).
        loss: ``"cross_entropy"`` (next-token), or ``"dpo"`` / ``"orpo"``: a preference loss over
            windows that alternate a pair's chosen and rejected answer, which :func:`preference`
            drives through :attr:`optimizer` (patch 0054).
        beta: DPO's beta or ORPO's lambda (> 0) of a preference loss.
        group: a data-parallel run's :class:`~llamabind.train.distributed.ProcessGroup`: each optimizer step's
            gradients are averaged over its ranks before the step (patch 0102); :meth:`step` then takes this
            rank's windows and returns this rank's loss.

    Raises TypeError/ValueError for bad arguments (naming them) and for a model training cannot use
    (:func:`check_model`: LoRA over a repacked quantized model, a full fine-tune without F32 weights
    loaded with use_mmap=False), LlamaError if llama.cpp cannot create the context. Close it (or
    use ``with``) to free the context; the model keeps the weights.
    """

    def __init__(
        self,
        model: Model,
        args: TrainingArgs | None = None,
        *,
        params: str = "model",
        adapter: LoraAdapter | None = None,
        profile: bool = False,
        loss: str = "cross_entropy",
        beta: float = 0.1,
        group: ProcessGroup | None = None,
        **settings: Any,
    ):
        a = self.args = TrainingArgs.of(args, **settings)
        self.ctx_size, self.batch_size, self.grad_accum = a.ctx_size, a.batch_size, a.grad_accum
        self.micro_batch = self.batch_size // self.grad_accum
        one_of(params, "params", ("model", "lora"))
        check_model(model, params == "lora")
        expect((adapter is not None) == (params == "lora"), "params='lora' takes an adapter, params='model' none")
        n = self.ctx_size * self.micro_batch
        # flash attention (patch 0050): by default where the output layer runs on a GPU; llama.cpp turns it
        # off where a layer's device has no backward pass for it (patch 0052)
        flash = a.flash_attn if a.flash_attn is not None else bool(model.output_offloaded)
        # packed (patch 0096): the micro-batch's windows in one KV stream, up to 256 documents
        self.context = Context(
            model, n_ctx=n, n_batch=n, n_ubatch=n, n_seq_max=MAX_DOCS if a.pack else self.micro_batch,
            kv_unified=a.pack or self.micro_batch == 1, n_threads=a.n_threads, training=True,
            training_profile=bool(profile), flash_attn="on" if flash else "off", packed=bool(a.pack),
        )  # fmt: skip
        precision = a.precision or ("bf16" if model.output_offloaded else "f32")
        try:
            if adapter is not None:
                self.context.set_lora(adapter, 1.0)
            with _bf16_inputs_off(params == "lora" and not flash and precision == "bf16" and model.output_offloaded):
                self.optimizer = Optimizer(
                    self.context, a.optimizer, a.lr, a.weight_decay, params, self.grad_accum, a.train_embeddings,
                    precision, loss, beta, a.gradient_checkpointing, a.max_grad_norm, a.loss_chunk_tokens,
                    None if group is None else group.reducer(a.ddp_bucket_cap_mb),
                )  # fmt: skip
        except BaseException:
            self.context.close()
            raise

    def close(self) -> None:
        """Free the training context (the model and adapter keep their trained weights)."""
        self.context.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def set_lr(self, lr: float) -> None:
        """Set ``lr`` (> 0) as the learning rate of the next optimizer steps (ggml-opt reads it at each step)."""
        self._check_open()
        self.optimizer.set_lr(lr)

    def step(
        self, windows: np.ndarray, labels: np.ndarray | None = None, segments: np.ndarray | None = None
    ) -> tuple[float, float, int]:
        """One optimizer step over ``windows``, int (batch_size, ctx_size + 1) token ids: the
        next-token cross-entropy of windows[:, :-1] against windows[:, 1:], or against ``labels``,
        int (batch_size, ctx_size), -1 leaving a position out (patch 0027); the loss the step
        follows is the mean over the micro-batch's labelled positions (PyTorch's batch mean).
        With ``pack``: ``segments``, int (batch_size, ctx_size), each position's document in its window,
        counted from 0 in steps of 1 (:func:`~llamabind.train.packed_windows`; None: a document a
        window), at most 256 documents a micro-batch.
        Returns (mean loss per labelled token in nats, next-token accuracy, labelled tokens),
        token-weighted over the micro-batches. Raises TypeError/ValueError for other shapes, ids
        outside [0, n_vocab), or a micro-batch whose labels are all -1."""
        self._check_open()
        w, lab = self._check(windows, labels, self.batch_size)
        seg = self._segments(segments, w.shape[0])
        m = self.micro_batch
        if lab is not None:  # before any micro-batch runs: a refused one would leave a step half-accumulated
            for k in range(0, self.batch_size, m):
                if not (lab[k : k + m] >= 0).any():
                    raise ValueError(
                        f"every label of windows [{k}, {k + m}) is masked (-1): nothing to learn from them"
                    )
        self.optimizer.reset()
        for k in range(0, self.batch_size, m):
            self.optimizer.eval(
                w[k : k + m], True, None if lab is None else lab[k : k + m], segments=_rows(seg, k, k + m)
            )
        return self.optimizer.result(True)

    def evaluate(
        self, windows: np.ndarray, labels: np.ndarray | None = None, segments: np.ndarray | None = None
    ) -> tuple[float, float, int]:
        """Forward passes only over any number of windows (shapes as :meth:`step`): (mean loss per
        labelled token, accuracy, labelled tokens), token-weighted; NaN, NaN, 0 for none; ``segments``
        with ``pack`` as in :meth:`step`. A last micro-batch short of windows is filled with copies whose
        labels are all -1 (not counted)."""
        self._check_open()
        w, lab = self._check(windows, labels, None)
        seg = self._segments(segments, w.shape[0])
        if not len(w):
            return float("nan"), float("nan"), 0
        if lab is None:
            lab = np.ascontiguousarray(w[:, 1:])
        m = self.micro_batch
        pad = -len(w) % m
        if pad:
            w = np.concatenate([w, np.repeat(w[-1:], pad, axis=0)])
            lab = np.concatenate([lab, np.full((pad, lab.shape[1]), -1, np.int32)])
            seg = None if seg is None else np.concatenate([seg, np.zeros((pad, seg.shape[1]), np.int32)])
        self.optimizer.reset()
        for k in range(0, len(w), m):
            self.optimizer.eval(w[k : k + m], False, lab[k : k + m], segments=_rows(seg, k, k + m))
        return self.optimizer.result(False)

    def state(self) -> tuple[int, list[tuple[str, np.ndarray, np.ndarray]]]:
        """The optimizer's state, for checkpoints: ``(iter, [(name, m, v), ...])``: AdamW's step
        counter (the next step's bias correction; 1 before any step) and, per trained tensor (by
        its GGUF name), copies of its first and second moments, float32, shape (n_elements,)
        (an empty list for SGD). Wraps ggml_opt_get_iter / ggml_opt_get_param (patch 0028).
        Raises ValueError before the first :meth:`step` or :meth:`evaluate` (ggml-opt allocates
        the moments with its first graph)."""
        self._check_open()
        return self.optimizer.state()

    def set_state(self, iter: int, state: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> None:
        """Set the optimizer state saved by :meth:`state` (same model or adapter shapes, same
        optimizer): every trained tensor by name with as many float32 values; nothing is written
        unless all are. Raises ValueError (a missing or extra tensor, a wrong size, iter < 1,
        before the first step). Wraps ggml_opt_set_iter and ggml_backend_tensor_set (patch 0028)."""
        self._check_open()
        self.optimizer.set_state(iter, state)

    def stats(self) -> dict[str, float]:
        """Where the time went since the first step (llama_opt_get_stats, patch 0032): ``n_evals``
        (micro-batches run), ``n_graph_builds`` (forward graphs built), ``n_opt_builds``
        (backward/optimizer graphs built), ``n_graph_allocs`` (scheduler allocations),
        ``n_kept_batches`` (micro-batches that reused the last one's ubatch and memory state: the same
        layout of windows and labelled positions, patch 0063), and milliseconds ``t_prepare_ms`` (the
        batch and memory state on the host), ``t_build_ms``, ``t_alloc_ms``, ``t_inputs_ms``,
        ``t_eval_ms`` (compute); ``compute_buffer_bytes``: the largest of the graphs' compute buffers
        (activations and the backward pass's temporaries, summed over the backends; patch 0066)."""
        self._check_open()
        return self.optimizer.stats()

    def profile(self) -> list[dict[str, Any]]:
        """Per phase ("forward", "backward", "optimizer") and ggml op: milliseconds and nodes
        timed since the last call, slowest first; needs ``profile=True`` (ValueError otherwise).
        The scheduler runs every node on its own and waits for it: the times are the ops'
        compute plus a launch and a synchronization each."""
        self._check_open()
        rows = [dict(phase=p, op=op, ms=ms, nodes=n) for p, op, ms, n in self.optimizer.profile()]
        return sorted(rows, key=lambda r: -r["ms"])

    def _check_open(self) -> None:
        if self.context.closed:
            raise ValueError("this Trainer is closed: make a new one (its training context was freed)")

    def _segments(self, segments, rows: int) -> np.ndarray | None:
        """segments as int32 (rows, ctx_size), or None; ValueError without ``pack`` (the rest: opt_step)."""
        if segments is None:
            return None
        expect(bool(self.args.pack), "segments are for a Trainer made with pack=True (packed windows)")
        seg = np.asarray(segments)
        if seg.ndim != 2 or not np.issubdtype(seg.dtype, np.integer):
            raise TypeError(f"segments must be a 2-D integer array (windows, ctx_size); got {seg.dtype} {seg.shape}")
        expect(
            seg.shape == (rows, self.ctx_size), f"segments must have the shape {(rows, self.ctx_size)}; got {seg.shape}"
        )
        expect(not seg.size or (seg.min() >= 0 and seg.max() < MAX_DOCS), "segments: document indices are in [0, 256)")
        if not seg.size:
            return np.ascontiguousarray(seg, dtype=np.int32)
        # checked before any micro-batch runs (opt_step checks again): a refused one would leave a step half-done
        steps = np.diff(seg, axis=1)
        expect(
            (seg[:, 0] == 0).all() and ((steps == 0) | (steps == 1)).all(),
            "segments must count each window's documents from 0 in steps of 1",
        )
        per_micro = np.add.reduceat(seg[:, -1].astype(np.int64) + 1, np.arange(0, rows, self.micro_batch))
        if (per_micro > MAX_DOCS).any():
            raise ValueError(f"a micro-batch holds at most {MAX_DOCS} documents; got {per_micro.max()}")
        return np.ascontiguousarray(seg, dtype=np.int32)

    def _check(self, windows, labels, rows: int | None) -> tuple[np.ndarray, np.ndarray | None]:
        w = np.asarray(windows)
        if w.ndim != 2 or not np.issubdtype(w.dtype, np.integer):
            raise TypeError(f"windows must be a 2-D integer array (windows, ctx_size + 1); got {w.dtype} {w.shape}")
        if w.shape[1] != self.ctx_size + 1 or (rows is not None and w.shape[0] != rows):
            want = f"({'n' if rows is None else rows}, {self.ctx_size + 1})"
            raise ValueError(f"windows must have the shape {want}; got {w.shape}")
        if w.size and (w.min() < 0 or w.max() >= 2**31):
            raise ValueError("windows: token ids must be in [0, n_vocab)")
        lab = None
        if labels is not None:
            lab = np.asarray(labels)
            if lab.ndim != 2 or not np.issubdtype(lab.dtype, np.integer):
                raise TypeError(f"labels must be a 2-D integer array (windows, ctx_size); got {lab.dtype} {lab.shape}")
            if lab.shape != (w.shape[0], self.ctx_size):
                raise ValueError(f"labels must have the shape {(w.shape[0], self.ctx_size)}; got {lab.shape}")
            if lab.size and (lab.min() < -1 or lab.max() >= 2**31):
                raise ValueError("labels: ids must be in [0, n_vocab) or -1")
            lab = np.ascontiguousarray(lab, dtype=np.int32)
        return np.ascontiguousarray(w, dtype=np.int32), lab


def _rows(a: np.ndarray | None, lo: int, hi: int) -> np.ndarray | None:
    return None if a is None else a[lo:hi]
