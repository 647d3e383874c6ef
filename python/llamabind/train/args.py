"""A fine-tuning run's settings in one documented dataclass, :class:`TrainingArgs` (mlx-lm's
TrainingArgs, TRL's SFTConfig): shared by :func:`~llamabind.train.finetune`,
:class:`~llamabind.train.Trainer` and ``python -m llamabind finetune``, and checked in one place."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._validate import as_float, as_int, expect, one_of
from .distributed import BACKENDS
from .schedule import check_schedule

__all__ = ["PRECISIONS", "TrainingArgs"]

PRECISIONS = ("bf16", "f32")
"""Values of :attr:`TrainingArgs.precision`."""


def _opt_int(value: Any, name: str, lo: int) -> int | None:
    return None if value is None else as_int(value, name, lo)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False; got {type(value).__name__} {value!r}")
    return value


def _check_dir(path: Any, name: str) -> None:
    """ValueError for a directory that cannot be one: empty, or an existing file (found now, not at the
    first checkpoint after the training)."""
    if path is None or not isinstance(path, (str, os.PathLike)):
        return
    expect(str(path).strip() != "", f"{name} must name a directory; got an empty string")
    expect(not os.path.isfile(path), f"{name} {str(path)!r} is a file, not a directory")


@dataclass(frozen=True)
class TrainingArgs:
    """The settings of a fine-tuning run. Every field has a default; :meth:`replace` (or
    ``dataclasses.replace``) makes a variant, and the functions that take one also take its fields as
    keyword arguments (``finetune(model, data, lr=1e-4)`` is ``finetune(model, data,
    TrainingArgs(lr=1e-4))``). :meth:`checked` validates them (TypeError/ValueError naming the field).

    Attributes:
        ctx_size: tokens per window, a multiple of 256 (llama.cpp pads each sequence to 256).
        batch_size: windows per optimizer step; the step follows the mean loss over the batch's
            counted positions (PyTorch's batch mean). A micro-batch's windows run as one graph, one
            sequence each (patch 0031).
        grad_accum: micro-batches per step (batch_size = micro-batch x grad_accum; patch 0025), for
            batches whose graph does not fit in memory.
        epochs: passes over the train windows (shuffled each epoch with ``seed`` unless ``shuffle``
            is False).
        iters: optimizer steps in all (mlx-lm's ``--iters``), instead of ``epochs``.
        lr: the learning rate (> 0); the peak of ``lr_schedule``.
        optimizer: ggml-opt's ``"adamw"`` (betas 0.9, 0.999, eps 1e-8, torch.optim.AdamW's) or ``"sgd"``.
        weight_decay: decoupled weight decay, in [0, 1].
        lr_schedule: ``"constant"``, ``"cosine"`` or ``"linear"`` decay from lr towards ``min_lr``
            over the run, after ``warmup`` steps of linear warmup (:func:`~llamabind.train.lr_at`).
        warmup: steps of linear warmup.
        min_lr: where cosine/linear decay heads, in [0, lr).
        val_split: the fraction of windows (the last ones) held out for validation, in [0, 0.9].
        seed: shuffling and LoRA initialization seed.
        shuffle: shuffle the windows each epoch (False: in order, as llama-finetune).
        train_embeddings: a full fine-tune trains token_embd too (with a tied output matrix, as
            PyTorch; patch 0033); False freezes it.
        lora_rank: train a LoRA adapter of this rank over the frozen model (None: every weight).
        lora_alpha: LoRA alpha (default 2 x rank): the adapter's product is scaled by alpha / rank.
        lora_targets: the matrices of every layer LoRA adapts (names from :data:`~llamabind.train.LORA_TARGETS`),
            or ``"all-linear"`` (peft's name): all seven.
        precision: ``"bf16"``: products of F32 weights and activations in BF16 with F32
            accumulation, forward and backward, where the backend has them (CUDA from Ampere on,
            patches 0051-0052; CPUs with AVX512_BF16, patch 0055), the F32 weights and AdamW's
            moments staying the master copy, as PyTorch's bf16 autocast; elsewhere (Vulkan, other
            CPUs) F32. ``"f32"``: F32 products (on NVIDIA GPUs cuBLAS runs them in TF32, ggml-cuda's
            math mode). None (default): ``"bf16"`` when the model's output layer is on a GPU,
            ``"f32"`` on the CPU (as PyTorch, whose CPU autocast is asked for).
        flash_attn: attention through ggml_flash_attn_ext and its backward pass (patch 0050; on CUDA
            0051): no n_ctx x n_ctx matrix per head in memory. None (default): on when the model's
            output layer is on a GPU, off on the CPU; True asks for it anywhere (llama.cpp turns it
            off, with a log line, where a layer's device has no backward pass); False: composed
            attention (KQ, soft_max, KQV).
        max_grad_norm: clip the gradients to this global L2 norm before each optimizer step
            (``torch.nn.utils.clip_grad_norm_``; transformers' and TRL's ``max_grad_norm``, whose default is
            1.0; patch 0094); None (default): no clipping, as llama.cpp's finetune.
        gradient_checkpointing: recompute each layer's activations in the backward pass instead of
            keeping them from the forward pass (patch 0066): only the layers' outputs stay in memory,
            for one more forward pass's compute (PyTorch's / transformers' gradient checkpointing).
        loss_chunk_tokens: the next-token cross-entropy, and the output product before it, computed in chunks
            of this many labelled tokens, each chunk's logits recomputed for the backward pass (a fused linear
            cross-entropy, as Liger-Kernel's; patch 0098): a window's [tokens, n_vocab] logits and their gradient
            never exist whole (6.4 GB each in F32 for 32,768 tokens of a 49,152-token vocabulary), for ~1% more
            compute. None (default): automatic, chunks of <= 512 MiB of logits where a window's exceed 2 GiB; 0:
            whole, as before. Under :func:`~llamabind.train.grpo`, whose loss is not a cross-entropy: the size
            of its micro-batches instead (:func:`~llamabind.train.grpo.loss_splits`).
        pack: pack the examples (JSONL rows, a dataset's rows) into windows, several a window, instead of a
            window each padded to ctx_size (sequence packing, TRL's ``padding_free`` packing, mlx-lm's): each
            example attends only to itself and its positions start at 0, so it trains as alone in a window
            (patch 0096), and no window position is padding but a window's last few. Best-fit decreasing
            over the examples' lengths, at most 256 // (batch_size // grad_accum) a window. Text and token ids,
            cut into full windows, are not packed (ValueError). None (default): not packed. Preference pairs
            (:func:`preference`): a micro-batch's pairs in one window, each pair's prompt once for both answers
            (shared-prompt packing: :func:`~llamabind.train.pack_pairs`; the same losses and gradients), the window
            fitted to the longest pairs rather than ctx_size; None: packed where the output layer runs on a CUDA
            GPU with flash attention (whose kernels skip the other pairs' tiles: 1.25-1.35x the unpacked step on an
            H200), not on the CPU (its attention spans the whole packed window: 1.6x slower there).
        steps_per_eval: also validate every N steps.
        steps_per_report: print step, loss, lr, tokens/s and ETA to stderr every N steps.
        log: a JSONL file, one object per step and per validation.
        checkpoint_dir: where checkpoints go (``step-NNNNNNN/``).
        save_every: write a checkpoint every N steps (and at the end, and on Ctrl-C); needs checkpoint_dir.
        n_threads: CPU threads (None: the default).
        progress: a tqdm bar with the loss and tokens/s.
        ddp_backend: under a data-parallel launch (torchrun: WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR,
            MASTER_PORT set; :mod:`llamabind.train.distributed`), torch.distributed's backend for the gradients'
            all-reduce before each step, ``"gloo"`` or ``"nccl"`` (transformers' ``ddp_backend``); None (default):
            "nccl" where the model's output layer runs on a CUDA GPU, "gloo" otherwise. In such a launch
            ``batch_size`` is per rank (TRL's ``per_device_train_batch_size``): a step takes batch_size x
            WORLD_SIZE windows, the ones a single process with that batch_size would take, split over the ranks.
            Not used outside a launch.
        ddp_timeout: seconds a collective waits for the other ranks before the run fails with an error
            (transformers' ``ddp_timeout``).
        ddp_bucket_cap_mb: MiB of gradients an all-reduce takes while the backward pass still runs, started as
            the backward pass finishes them (transformers' ``ddp_bucket_cap_mb``, PyTorch DDP's buckets, whose
            default is 25; here 128: the backward pass's GPU queue drains at each bucket, for the host to start
            its all-reduce, so fewer, larger ones; patch 0104). The last bucket is all-reduced after the backward
            pass. 0: all of them after it. ValueError if negative.
    """

    ctx_size: int = 256
    batch_size: int = 1
    grad_accum: int = 1
    epochs: int = 1
    iters: int | None = None
    lr: float = 1e-5
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    warmup: int = 0
    min_lr: float = 0.0
    val_split: float = 0.1
    seed: int = 0
    shuffle: bool = True
    train_embeddings: bool = True
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: Sequence[str] = field(default=("attn_q", "attn_v"))
    precision: str | None = None
    flash_attn: bool | None = None
    max_grad_norm: float | None = None
    gradient_checkpointing: bool = False
    loss_chunk_tokens: int | None = None
    pack: bool | None = None
    steps_per_eval: int | None = None
    steps_per_report: int | None = None
    log: str | os.PathLike | None = None
    checkpoint_dir: str | os.PathLike | None = None
    save_every: int | None = None
    n_threads: int | None = None
    progress: bool = True
    ddp_backend: str | None = None
    ddp_timeout: int = 1800
    ddp_bucket_cap_mb: float = 128.0

    @classmethod
    def of(cls, args: TrainingArgs | None = None, **settings: Any) -> TrainingArgs:
        """``args`` (default: the defaults) with ``settings`` replaced, checked. TypeError names a
        setting that is not a field; see :meth:`checked` for the rest."""
        if args is not None and not isinstance(args, TrainingArgs):
            raise TypeError(f"args must be a train.TrainingArgs; got {type(args).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise TypeError(f"unknown training setting(s) {', '.join(unknown)}: see train.TrainingArgs")
        return dataclasses.replace(args if args is not None else cls(), **settings).checked()

    def replace(self, **settings: Any) -> TrainingArgs:
        """A copy with ``settings`` replaced, checked."""
        return TrainingArgs.of(self, **settings)

    @property
    def lora(self) -> bool:
        """Whether the run trains a LoRA adapter (``lora_rank`` set)."""
        return self.lora_rank is not None

    def checked(self) -> TrainingArgs:
        """The same settings, normalized (lora_alpha filled in, lora_targets a tuple); TypeError for a
        value of the wrong type, ValueError out of range, each naming its field."""
        ctx_size = as_int(self.ctx_size, "ctx_size", 256)
        expect(ctx_size % 256 == 0, f"ctx_size must be a multiple of 256 (llama.cpp pads n_ctx to 256); got {ctx_size}")
        batch_size = as_int(self.batch_size, "batch_size", 1, 65536)
        grad_accum = as_int(self.grad_accum, "grad_accum", 1, 65536)
        expect(batch_size % grad_accum == 0, f"grad_accum ({grad_accum}) must divide batch_size ({batch_size})")
        expect(
            batch_size // grad_accum <= 256,
            f"batch_size // grad_accum (windows in one graph) must be <= 256; got {batch_size // grad_accum}",
        )
        lr = as_float(self.lr, "lr")
        expect(lr > 0, f"lr must be > 0; got {lr}")
        warmup, min_lr = check_schedule(self.lr_schedule, self.warmup, lr, self.min_lr)
        rank = _opt_int(self.lora_rank, "lora_rank", 1)
        alpha = None
        if rank is not None:  # > 0: llama.cpp reads an alpha of 0 as "scale 1", not as no adapter
            alpha = as_float(2.0 * rank if self.lora_alpha is None else self.lora_alpha, "lora_alpha")
            expect(alpha > 0, f"lora_alpha must be > 0 (the adapter's scale is alpha / rank); got {alpha}")
        targets = self.lora_targets
        if targets == "all-linear":  # peft's name: every matrix of a block
            from .lora import LORA_TARGETS

            targets = LORA_TARGETS
        if (
            isinstance(targets, str)
            or not isinstance(targets, Sequence)
            or not all(isinstance(t, str) for t in targets)
        ):
            raise TypeError(
                f"lora_targets must be a sequence of matrix names, e.g. ('attn_q', 'attn_v'); got {targets!r}"
            )
        save_every = _opt_int(self.save_every, "save_every", 1)
        expect(save_every is None or self.checkpoint_dir is not None, "save_every needs a checkpoint_dir")
        _check_dir(self.checkpoint_dir, "checkpoint_dir")
        for name in ("log", "checkpoint_dir"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, (str, os.PathLike)):
                raise TypeError(f"{name} must be a path; got {type(v).__name__}")
        if self.flash_attn is not None:
            _bool(self.flash_attn, "flash_attn")
        max_grad_norm = None
        if self.max_grad_norm is not None:
            max_grad_norm = as_float(
                self.max_grad_norm, "max_grad_norm", 0.0, lo_open=True, note=" (None: no clipping)"
            )
        return dataclasses.replace(
            self,
            ctx_size=ctx_size,
            batch_size=batch_size,
            grad_accum=grad_accum,
            epochs=as_int(self.epochs, "epochs", 1),
            iters=_opt_int(self.iters, "iters", 1),
            lr=lr,
            optimizer=one_of(self.optimizer, "optimizer", ("adamw", "sgd")),
            weight_decay=as_float(self.weight_decay, "weight_decay", 0.0, 1.0),
            warmup=warmup,
            min_lr=min_lr,
            val_split=as_float(self.val_split, "val_split", 0.0, 0.9),
            seed=as_int(self.seed, "seed", 0),
            shuffle=_bool(self.shuffle, "shuffle"),
            max_grad_norm=max_grad_norm,
            gradient_checkpointing=_bool(self.gradient_checkpointing, "gradient_checkpointing"),
            loss_chunk_tokens=_opt_int(self.loss_chunk_tokens, "loss_chunk_tokens", 0),
            pack=None if self.pack is None else _bool(self.pack, "pack"),
            train_embeddings=_bool(self.train_embeddings, "train_embeddings"),
            lora_rank=rank,
            lora_alpha=alpha,
            lora_targets=tuple(targets),
            precision=None if self.precision is None else one_of(self.precision, "precision", PRECISIONS),
            steps_per_eval=_opt_int(self.steps_per_eval, "steps_per_eval", 1),
            steps_per_report=_opt_int(self.steps_per_report, "steps_per_report", 1),
            save_every=save_every,
            n_threads=_opt_int(self.n_threads, "n_threads", 1),
            progress=_bool(self.progress, "progress"),
            ddp_backend=None if self.ddp_backend is None else one_of(self.ddp_backend, "ddp_backend", BACKENDS),
            ddp_timeout=as_int(self.ddp_timeout, "ddp_timeout", 1),
            ddp_bucket_cap_mb=as_float(self.ddp_bucket_cap_mb, "ddp_bucket_cap_mb", 0.0),
        )
