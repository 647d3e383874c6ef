"""GRPO (issue 85): online reinforcement learning from rewards, DeepSeekMath's Group Relative Policy Optimization
(Shao et al. 2024) as TRL 1.16's GRPOTrainer computes it, on the GGUF you have. Each step samples
``num_generations`` completions of a few prompts from the policy being trained (:mod:`.rollout`: llama.cpp's
batched decode over the same weights, the LoRA adapter being trained applied), scores them with Python reward
functions, normalizes the rewards within each prompt's group into advantages and trains on the completions'
tokens with TRL's clipped-ratio loss (:mod:`.grpo_math`), in ggml-opt's training graph (``loss="grpo"``: each
token's log-probability times the loss's derivative in it, so the backward pass is TRL's gradient)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from .._validate import as_float, as_int, expect, one_of
from ..context import Context
from ..model import LoraAdapter, Model
from ..sampling import SamplingParams
from .args import TrainingArgs
from .checkpoint import restore_optimizer, save_checkpoint
from .distributed import ProcessGroup, process_group, reports
from .grpo_math import LOSS_TYPES, group_advantages, token_loss
from .loop import _new_adapter, _resumable, iterate_batches
from .rollout import (
    Batch,
    GRPOPrompt,
    RewardFunc,
    Roller,
    batch_windows,
    pack_completions,
    read_prompts,
    reference_logps,
    reward_name,
    score,
)
from .schedule import lr_at
from .trainer import Trainer, check_model

__all__ = ["GRPOConfig", "GRPOResult", "grpo"]


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO's settings, with TRL 1.16 GRPOConfig's names and defaults (the rest of a run's settings are
    :class:`~llamabind.train.TrainingArgs`'). ValueError/TypeError naming a field out of range.

    Attributes:
        num_generations: completions sampled per prompt (G, >= 2); a step's ``batch_size`` completions are
            ``batch_size / G`` prompts' groups.
        max_completion_length: the most tokens a completion has (TRL: 512).
        max_prompt_length: a longer prompt keeps its last tokens (TRL truncates on the left); None: none cut.
        temperature: the rollouts' sampling temperature (> 0); the log-probabilities are of logits / temperature,
            as TRL's.
        top_p: the rollouts' nucleus sampling (llama.cpp's sampler chain); 1 is off.
        top_k: the rollouts' top-k; 0 is off.
        min_p: the rollouts' min-p; 0 is off.
        repetition_penalty: the rollouts' repetition penalty; 1 is off.
        beta: the KL coefficient (k3 estimator) to the reference: the model as the run starts (a new LoRA
            adapter's base; for a full fine-tune the GGUF loaded again). 0 (TRL's default): no reference.
        epsilon: the ratio's clipping below, 1 - epsilon.
        epsilon_high: the ratio's clipping above, 1 + epsilon_high (None: epsilon).
        num_iterations: optimizer steps on each generation batch (TRL's mu); above 1 the ratio moves
            away from 1 and its clipping applies.
        loss_type: ``"dapo"`` (TRL's default: the token sum over the generation batch's tokens), ``"grpo"``
            (each completion's token mean, then their mean), ``"bnpo"`` (the micro-batch's token mean) or
            ``"dr_grpo"`` (the token sum over completions x max_completion_length).
        scale_rewards: ``"group"`` (advantages divided by the group's reward standard deviation),
            ``"batch"`` or ``"none"`` (Dr. GRPO).
        mask_truncated_completions: a completion that reached max_completion_length without ending does not
            train (DAPO).
        reward_weights: one weight per reward function (None: 1 each).
        use_bias_correction_kl: the KL term times the ratio (TRL's default since DeepSeek-V3.2).
        seed: the rollouts' sampling seed (completion i of step s: seed + s x 4096 + i); None: random.
    """

    num_generations: int = 8
    max_completion_length: int = 512
    max_prompt_length: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    num_iterations: int = 1
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    mask_truncated_completions: bool = False
    reward_weights: Sequence[float] | None = None
    use_bias_correction_kl: bool = True
    seed: int | None = 0

    def __post_init__(self) -> None:
        as_int(self.num_generations, "num_generations", 2, 256)
        as_int(self.max_completion_length, "max_completion_length", 1)
        if self.max_prompt_length is not None:
            as_int(self.max_prompt_length, "max_prompt_length", 1)
        t = as_float(self.temperature, "temperature")
        expect(t > 0 and math.isfinite(t), f"temperature must be > 0 (sampling; 0 would be greedy); got {t}")
        for name in ("beta", "epsilon"):
            v = as_float(getattr(self, name), name)
            expect(v >= 0 and math.isfinite(v), f"{name} must be a finite number >= 0; got {v}")
        if self.epsilon_high is not None:
            v = as_float(self.epsilon_high, "epsilon_high")
            expect(v >= 0 and math.isfinite(v), f"epsilon_high must be a finite number >= 0; got {v}")
        as_int(self.num_iterations, "num_iterations", 1)
        one_of(self.loss_type, "loss_type", LOSS_TYPES)
        one_of(self.scale_rewards, "scale_rewards", ("group", "batch", "none"))
        if self.seed is not None:
            as_int(self.seed, "seed", 0)
        for name in ("top_p", "min_p"):
            as_float(getattr(self, name), name)
        rp = as_float(self.repetition_penalty, "repetition_penalty")
        expect(rp > 0 and math.isfinite(rp), f"repetition_penalty must be a finite number > 0 (1: off); got {rp}")
        as_int(self.top_k, "top_k", 0)
        self.sampling(None)  # the sampler chain's own ranges (top_p in (0, 1], ...), each error naming its field

    def sampling(self, seed: int | None) -> SamplingParams:
        """The rollouts' sampler chain settings with ``seed`` (None: random), as SamplingParams (ValueError for an
        out-of-range one)."""
        return SamplingParams(
            temperature=float(self.temperature), top_p=float(self.top_p), top_k=int(self.top_k),
            min_p=float(self.min_p), repeat_penalty=float(self.repetition_penalty), seed=seed,
        )  # fmt: skip


@dataclass
class GRPOResult:
    """What :func:`grpo` did: ``steps`` optimizer steps, ``losses`` and ``metrics`` per step (TRL's logged
    names: loss, reward, reward_std, rewards/NAME/mean, kl, clip_ratio/region_mean, completions/mean_length,
    completions/clipped_ratio, frac_reward_zero_std), ``val_before`` and ``evals`` [(step, mean reward)] of the
    held-out prompts, ``adapter`` the trained LoRA adapter (None for a full fine-tune), ``interrupted`` by
    Ctrl-C, ``checkpoints`` written."""

    steps: int = 0
    losses: list[float] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    val_before: float | None = None
    evals: list[tuple[int, float]] = field(default_factory=list)
    adapter: LoraAdapter | None = None
    interrupted: bool = False
    checkpoints: list[Path] = field(default_factory=list)


def _check_config(config: GRPOConfig | None, funcs: Any) -> tuple[GRPOConfig, list[RewardFunc], np.ndarray]:
    config = config if config is not None else GRPOConfig()
    expect(isinstance(config, GRPOConfig), f"config must be a GRPOConfig; got {type(config).__name__}")
    funcs = [funcs] if callable(funcs) else list(funcs or [])
    expect(len(funcs) > 0, "reward_funcs: give at least one reward function f(prompts, completions, **columns)")
    for f in funcs:
        if not callable(f):
            raise TypeError(f"reward_funcs: {f!r} is not callable")
    weights = np.ones(len(funcs)) if config.reward_weights is None else np.asarray(config.reward_weights, np.float64)
    expect(
        weights.shape == (len(funcs),) and bool(np.isfinite(weights).all()),
        f"reward_weights must hold one finite weight per reward function ({len(funcs)}); got {config.reward_weights!r}",
    )
    return config, funcs, weights


class _GRPORun:
    """What one :func:`grpo` call's steps share: the Trainer, the rollout context, the reference's."""

    def __init__(
        self, model: Model, a: TrainingArgs, c: GRPOConfig, funcs, weights, longest: int, adapter, ref_model,
        group: ProcessGroup | None = None,
    ) -> None:  # fmt: skip
        self.model, self.a, self.c, self.funcs, self.weights = model, a, c, funcs, weights
        self.group = group  # a data-parallel run's: each rank its prompts of a step, rank 0 logs and checkpoints
        self.world = group.world_size if group else 1
        self.W = -(-longest // 256) * 256  # a completion's window (unpacked)
        self.G = c.num_generations
        self.eps_high = c.epsilon if c.epsilon_high is None else c.epsilon_high
        self.pad = model.token_eos if model.token_eos is not None and model.token_eos >= 0 else 0
        # the micro-batches an optimizer step takes: grad_accum's, each split further where its loss's logits would
        # be large (loss_chunk_tokens; the same gradient: the loss's coefficients are scaled by the count)
        self.n_micro = a.grad_accum * loss_splits(
            a.batch_size // a.grad_accum, c.max_completion_length, model.n_vocab, a.loss_chunk_tokens
        )
        m = a.batch_size // self.n_micro
        # packed (TrainingArgs.pack None or True): a micro-batch's completions back to back in one window sized for
        # the longest prompt and completion each, every completion its own document: no position of padding
        self.packed = a.pack is not False
        self.n_pack = -(-m * longest // 256) * 256
        targs = (
            a.replace(ctx_size=self.n_pack, batch_size=self.n_micro, grad_accum=self.n_micro, pack=True, val_split=0.0)
            if self.packed
            else a.replace(ctx_size=self.W, grad_accum=self.n_micro, pack=False, val_split=0.0)
        )
        self.trainer = Trainer(
            model, targs, params="lora" if adapter else "model", adapter=adapter, loss="grpo",
            beta=float(c.temperature), group=group,
        )  # fmt: skip
        self.roller: Roller | None = None
        self.ref_ctx: Context | None = None
        self.own_ref: Model | None = None  # the reference this run loaded (closed with it)
        try:
            self.roller = Roller(model, a.batch_size, self.W + 1, adapter, a.n_threads)
            if c.beta > 0:  # the reference: the base under a LoRA adapter, else the GGUF loaded again
                ref = ref_model if ref_model is not None else model if adapter is not None else None
                if ref is None:
                    ref = self.own_ref = Model(model.path, n_threads=a.n_threads)
                n = self.W + 256
                self.ref_ctx = Context(ref, n_ctx=n, n_batch=n, n_ubatch=n, n_threads=a.n_threads, training=True)
        except BaseException:
            self.close()
            raise
        self.log: IO[str] | None = None
        self.run_id: dict[str, Any] = {}
        self.total, self.saved = 0, 0

    def close(self) -> None:
        for x in (self.trainer, self.roller, self.ref_ctx, self.own_ref):
            if x is not None:
                x.close()

    def prompt_ids(self, prompts: Sequence[GRPOPrompt]) -> list[np.ndarray]:
        n = self.c.max_prompt_length
        return [p.ids if n is None else p.ids[-n:] for p in prompts]

    def generate(self, prompts: Sequence[GRPOPrompt], step: int) -> tuple[Batch, dict[str, float]]:
        """A generation batch: rollouts, rewards, advantages, windows (and the reference's log-probabilities)."""
        c, G, g = self.c, self.G, self.group
        ids = self.prompt_ids(prompts)
        # completion i of the step's (all ranks') seeded seed + i: rank r's prompts follow ranks < r's
        seed = None if c.seed is None else c.seed + step * 4096 + (g.rank * len(ids) * G if g else 0)
        assert self.roller is not None
        r = self.roller(ids, G, c.max_completion_length, c.sampling(seed))
        per_func = score(self.funcs, prompts, r, G)
        lengths = np.array([len(x) for x in r.completions], np.float64)
        trunc = r.truncated.astype(np.float64)
        n, at = len(lengths), 0
        if g is not None:  # every rank's completions, in the step's order: advantages and metrics as one process's
            cols = g.gather_rows(np.column_stack([lengths, trunc, per_func]))
            lengths, trunc, per_func, at = cols[:, 0], cols[:, 1], cols[:, 2:], g.rank * n
        adv, rewards, std = group_advantages(per_func, self.weights, G, c.scale_rewards)
        b = batch_windows(ids, r, G, self.W, self.pad, c.mask_truncated_completions)
        b.advantages = adv[at : at + n]  # this rank's
        if self.ref_ctx is not None:
            b.ref = reference_logps(self.ref_ctx, ids, r, G, b.mask.shape[1], c.temperature)
        m = {"reward": float(np.nanmean(rewards)), "reward_std": float(_std(rewards)),
             "frac_reward_zero_std": float(np.isclose(np.nan_to_num(std, nan=0.0), 0.0).mean()),
             "completions/mean_length": float(lengths.mean()), "completions/max_length": float(lengths.max()),
             "completions/clipped_ratio": float(trunc.mean()),
             "rollout_tokens_per_s": float(lengths.sum() / max(r.seconds, 1e-9)),
             "time/rollout_s": float(r.seconds), "time/rollout_sample_s": float(r.sample_seconds)}  # fmt: skip
        for j, f in enumerate(self.funcs):
            m[f"rewards/{reward_name(f)}/mean"] = float(np.nanmean(per_func[:, j]))
        return b, m

    def train_step(self, b: Batch, old: list[np.ndarray | None]) -> dict[str, float]:
        """One optimizer step over the generation batch ``b``, micro-batch by micro-batch; ``old``: per
        micro-batch the sampling policy's log-probabilities (None: this step's own, the ratio 1), filled in
        where this step computes them (num_iterations > 1)."""
        c, n_micro, opt, g = self.c, self.n_micro, self.trainer.optimizer, self.group
        m = self.a.batch_size // n_micro
        n_items = float(b.mask.sum() if g is None else g.all_reduce_sum([b.mask.sum()])[0])
        M = n_micro * self.world  # the step's micro-batches over the ranks, their gradients averaged
        need_logp = c.beta > 0 or c.num_iterations > 1
        loss, kl, clipped, n_tok = 0.0, 0.0, np.zeros(3), 0.0
        for k in range(n_micro):
            rows = slice(k * m, (k + 1) * m)
            win, lab, mask = b.windows[rows], b.labels[rows].copy(), b.mask[rows]
            sel = mask > 0
            if not sel.any():  # every completion masked (truncated): one token with coefficient 0 keeps the step
                p0 = int(b.prompt_len[k * m])
                lab[0, p0 - 1] = b.windows[k * m, p0]
                sel = np.zeros_like(sel)
                sel[0, 0] = True
            seg = None
            if self.packed:
                win, lab, seg = pack_completions(win, lab, b.seq_len[rows], self.n_pack, self.pad)
            logp, o = np.zeros(mask.shape), old[k]
            if need_logp:  # this step's log-probabilities: a forward pass of the training graph
                opt.eval(win, False, lab, np.zeros(int(sel.sum())), segments=seg)
                logp[sel] = opt.seq_logps()
                if o is None and c.num_iterations > 1:
                    old[k] = logp.copy()  # the sampling policy's, for the generation batch's later steps
            ref = None if b.ref is None else b.ref[rows]
            tl = token_loss(
                logp, o, ref, b.advantages[rows], mask,
                loss_type=c.loss_type, beta=c.beta, epsilon=c.epsilon, epsilon_high=self.eps_high,
                bias_correction_kl=c.use_bias_correction_kl, max_completion_length=c.max_completion_length,
                n_items=n_items, grad_accum=M,
            )  # fmt: skip
            # ggml-opt averages the micro-batches' gradients (patch 0025), grad_reduce the ranks': TRL sums their losses
            opt.eval(win, True, lab, (tl.coef * M)[sel], segments=seg)
            loss += tl.loss
            w = float(mask.sum())
            n_tok += w
            kl += (0.0 if math.isnan(tl.kl) else tl.kl) * w
            clipped += np.asarray(tl.clipped) * w
        if g is not None:  # the sums over every rank's micro-batches
            t = g.all_reduce_sum([loss, kl, *clipped, n_tok])
            loss, kl, clipped, n_tok = float(t[0]), float(t[1]), t[2:5], float(t[5])
        out = {"loss": loss, "clip_ratio/low_mean": clipped[0] / max(n_tok, 1.0),
               "clip_ratio/high_mean": clipped[1] / max(n_tok, 1.0),
               "clip_ratio/region_mean": clipped[2] / max(n_tok, 1.0)}  # fmt: skip
        if c.beta > 0:
            out["kl"] = kl / max(n_tok, 1.0)
        return out

    def evaluate(self, prompts: Sequence[GRPOPrompt]) -> float:
        """The held-out prompts' mean reward over G sampled completions each (the rollouts' settings, seeded)."""
        P = self.a.batch_size // self.G
        total, n = 0.0, 0
        for k in range(0, len(prompts), P):
            part = list(prompts[k : k + P])
            seed = None if self.c.seed is None else self.c.seed + 7919 + k
            assert self.roller is not None
            r = self.roller(self.prompt_ids(part), self.G, self.c.max_completion_length, self.c.sampling(seed))
            rewards = np.nansum(score(self.funcs, part, r, self.G) * self.weights[None, :], axis=1)
            total += float(rewards.sum())
            n += len(rewards)
        return total / max(n, 1)

    def allocate(self) -> None:
        """A forward pass (a window of one labelled token): ggml-opt's graphs and AdamW's moments allocated."""
        n, w = (1, self.n_pack) if self.packed else (self.a.batch_size // self.n_micro, self.W)
        win = np.full((n, w + 1), self.pad, np.int32)
        lab = np.full((n, w), -1, np.int32)
        lab[0, 0] = self.pad
        seg = np.zeros((1, w), np.int32) if self.packed else None
        self.trainer.optimizer.eval(win, False, lab, np.zeros(1), segments=seg)

    def checkpoint(self, r: GRPOResult) -> None:
        if self.a.checkpoint_dir is None or r.steps in (0, self.saved) or not self.main:
            return
        state = dict(self.run_id, step=r.steps, total=self.total, losses=r.losses)
        weights = self.model if r.adapter is None else r.adapter
        r.checkpoints.append(save_checkpoint(self.a.checkpoint_dir, self.trainer, weights, state))
        self.saved = r.steps

    def write(self, **row: Any) -> None:
        if self.log is not None:
            self.log.write(json.dumps(row) + "\n")
            self.log.flush()

    @property
    def main(self) -> bool:
        """Whether this process reports (:func:`~llamabind.train.distributed.reports`)."""
        return reports(self.group)


def loss_splits(m: int, max_completion_length: int, n_vocab: int, loss_chunk_tokens: int | None) -> int:
    """Into how many micro-batches GRPO splits each of grad_accum's (``m`` completions each): GRPO's loss holds
    several [tokens, n_vocab] F32 tensors of the labelled tokens at once (the logits, their softmax and, in the
    backward pass, the gradients of both: 1.6 GB each for 32 completions of 256 tokens over a 49,152-token
    vocabulary), so that its micro-batches are sized as TrainingArgs.loss_chunk_tokens sizes the cross-entropy's
    chunks: ``None`` (automatic) at most 512 MiB of logits each where they exceed it, ``0`` unsplit, ``n`` > 0 at
    most ``n`` completion tokens each (at least one completion). The smallest divisor of ``m`` that does it."""
    if loss_chunk_tokens == 0:
        return 1
    rows = max(max_completion_length, 1)
    per = (512 << 20) // (4 * max(n_vocab, 1)) if loss_chunk_tokens is None else loss_chunk_tokens
    return next(s for s in range(1, m + 1) if m % s == 0 and (m // s == 1 or m // s * rows <= per))


def _std(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(x.std(ddof=1)) if len(x) > 1 else float("nan")


def _longest(prompts: Sequence[GRPOPrompt], c: GRPOConfig, model: Model) -> int:
    """The most tokens a completion's sequence takes: the longest (cut) prompt and max_completion_length."""
    longest = max(len(p.ids) if c.max_prompt_length is None else min(len(p.ids), c.max_prompt_length) for p in prompts)
    n_train = int(model.metadata.get(f"{model.metadata.get('general.architecture')}.context_length", 0) or 0)
    expect(
        not n_train or longest + c.max_completion_length <= n_train,
        f"the longest prompt ({longest} tokens) + max_completion_length ({c.max_completion_length}) exceed the model's "
        f"context ({n_train}): set max_prompt_length or a smaller max_completion_length",
    )
    return longest + c.max_completion_length


def grpo(
    model: Model,
    prompts: Any,
    reward_funcs: RewardFunc | Sequence[RewardFunc],
    args: TrainingArgs | None = None,
    config: GRPOConfig | None = None,
    *,
    valid: Any = None,
    ref_model: Model | None = None,
    on_step: Callable[[int, dict[str, float]], Any] | None = None,
    resume: str | os.PathLike | None = None,
    **settings: Any,
) -> GRPOResult:
    """Train ``model`` with GRPO on rewards of its own completions (TRL 1.16's GRPOTrainer's algorithm, its
    GRPOConfig's names in ``config``): every weight (F32, use_mmap=False) or with ``lora_rank`` a new LoRA
    adapter over the frozen model (any weight type, repack=False: QLoRA).

    Args:
        model: the :class:`~llamabind.Model`; its weights (or the adapter's) change in place.
        prompts: a JSONL file, a list of dicts or a 🤗 Dataset with ``"prompt"`` (text, or messages rendered
            with the chat template's generation prompt; :func:`~llamabind.train.rollout.read_prompts`), or a list
            of strings. The rows' other fields go to the reward functions.
        reward_funcs: one or several callables with TRL's signature ``f(prompts, completions, completion_ids,
            **columns) -> list[float | None]`` (keyword arguments; accept ``**kwargs``), weighted by
            ``config.reward_weights`` and summed (None: not scored by that function).
        args: a :class:`~llamabind.train.TrainingArgs` (or its fields as keyword arguments): ``batch_size``
            completions a step (TRL's per_device_train_batch_size x gradient_accumulation_steps; a rank's under
            torchrun, the advantages and metrics from every rank's), a multiple of num_generations; ``grad_accum``
            micro-batches, split further where the loss's logits would be large (:func:`loss_splits`); ``iters``
            optimizer steps (else ``epochs`` over the prompts, times num_iterations); ``val_split`` / ``valid``
            held-out prompts, their mean reward measured before, every ``steps_per_eval`` and after; the schedule,
            LoRA, precision as :func:`~llamabind.train.finetune`. The training window is the longest prompt plus
            max_completion_length, a multiple of 256 (``ctx_size`` is not used).
        config: :class:`GRPOConfig` (None: TRL's defaults).
        valid: held-out prompts (as ``prompts``), instead of ``val_split``.
        ref_model: the reference for ``config.beta > 0`` in a full fine-tune (None: the GGUF loaded again).
        on_step: called as on_step(step, metrics) after each optimizer step.
        resume: a checkpoint (``save_every`` / ``checkpoint_dir``, as :func:`~llamabind.train.finetune`'s; or a
            checkpoint_dir: its newest) of the same run to continue from: the weights or adapter, AdamW's state,
            the step; the prompts come in the same order and the rollouts are seeded by the step, so the run
            continues as it would have (a checkpoint inside a generation batch, num_iterations > 1, samples that
            batch anew). ValueError naming what differs.

    Returns a :class:`GRPOResult`. Ctrl-C stops between steps and returns what was trained. Wraps
    llama_decode (rollouts) and llama_opt_epoch with llama_opt_params.build_loss (patch 0054).

    Where llamabind differs from TRL: the rollouts are llama.cpp's sampler chain (the same distribution:
    softmax(logits / temperature) filtered by top_k / top_p / min_p; another random stream); the
    reference's log-probabilities (beta > 0) come from llama_decode's logits; one optimizer step per
    generation batch and num_iterations (TRL's steps_per_generation = gradient_accumulation_steps); no
    vLLM, entropy masks or importance_sampling_level "sequence".

    Raises TypeError/ValueError for bad settings (naming the field), no prompts, a batch_size that is not a
    multiple of num_generations, a prompt + max_completion_length beyond the model's context, a model
    training cannot use; ValueError/RuntimeError naming a reward function that raised or returned the wrong
    thing (nothing trains on that step); FloatingPointError naming the step if the loss becomes NaN/inf."""
    c, funcs, weights = _check_config(config, reward_funcs)
    a = TrainingArgs.of(args, **settings)
    check_model(model, a.lora)
    G = c.num_generations
    expect(a.batch_size % G == 0, f"batch_size ({a.batch_size} completions a step) must be a multiple of "
           f"num_generations ({G}): batch_size / num_generations prompts a step")  # fmt: skip
    expect((a.batch_size // a.grad_accum) * a.grad_accum == a.batch_size, "grad_accum must divide batch_size")
    train_p, val_p = _prompt_sets(model, prompts, valid, a.val_split)
    group = process_group(a.ddp_backend, a.ddp_timeout, gpu=bool(model.output_offloaded))
    P = a.batch_size // G * (group.world_size if group else 1)  # prompts a step, over the ranks
    n_gen = -(-len(train_p) // P)
    total = a.iters if a.iters is not None else a.epochs * n_gen * c.num_iterations
    longest = _longest(train_p + val_p, c, model)
    result = GRPOResult()
    run_id = _run_id(a, c, longest, len(train_p), P * G)
    resumed = None if resume is None else _resumable(resume, run_id, total, model, a)
    if a.lora:
        result.adapter = _new_adapter(model, a) if resumed is None else model.load_lora(resumed[0] / "adapter.gguf")
    run = _GRPORun(model, a, c, funcs, weights, longest, result.adapter, ref_model, group)
    run.run_id, run.total = run_id, total
    try:
        if a.log is not None and run.main:
            run.log = open(a.log, "a", encoding="utf-8")  # noqa: SIM115 (closed in finally)
        result.val_before = run.evaluate(val_p) if val_p and resumed is None else None
        if resumed is not None:
            run.allocate()  # ggml-opt allocates AdamW's moments with its first graph
            restore_optimizer(run.trainer, *resumed)
            result.steps = int(resumed[1]["step"])
            result.losses = [float(x) for x in resumed[1]["losses"]]
        _loop(run, train_p, val_p, total, result, on_step)
        run.checkpoint(result)
        if (
            result.steps
            and val_p
            and not result.interrupted
            and (not result.evals or result.evals[-1][0] != result.steps)
        ):
            result.evals.append((result.steps, run.evaluate(val_p)))
    finally:
        run.close()
        if run.log is not None:
            run.log.close()
    return result


def _prompt_sets(model: Model, prompts: Any, valid: Any, val_split: float) -> tuple[list, list]:
    """(train, held-out) prompts: ``valid``'s, or the last ``val_split`` of ``prompts`` (at least one left to train)."""
    train_p = read_prompts(prompts, model, "prompts")
    val_p = read_prompts(valid, model, "valid") if valid is not None else []
    if valid is None and val_split and len(train_p) > 1:
        n_val = max(1, int(round(len(train_p) * val_split)))
        if len(train_p) - n_val >= 1:
            train_p, val_p = train_p[:-n_val], train_p[-n_val:]
    return train_p, val_p


def _run_id(a: TrainingArgs, c: GRPOConfig, longest: int, n_train: int, batch: int) -> dict:
    """What a checkpoint of the run records, for a resumed run to match (checkpoint.MUST_MATCH; ``batch``: the
    completions a step over the ranks)."""
    return dict(
        kind="lora" if a.lora else "full", ctx_size=longest, n_train=n_train, batch_size=batch, seed=a.seed,
        shuffle=a.shuffle, optimizer=a.optimizer, embeddings=a.train_embeddings and not a.lora,
        lora=None if not a.lora else dict(rank=a.lora_rank, alpha=a.lora_alpha, targets=list(a.lora_targets)),
        method="grpo", beta=c.beta, grpo={k: v for k, v in asdict(c).items() if k != "reward_weights"},
    )  # fmt: skip


def _report(step: int, total: int, m: dict[str, float], lr: float) -> None:
    print(
        f"step {step}/{total}: loss {m['loss']:.4f}, reward {m['reward']:.4f}, completion length "
        f"{m['completions/mean_length']:.1f}, lr {lr:.3g}, {m['rollout_tokens_per_s']:.1f} rollout tokens/s",
        file=sys.stderr, flush=True,
    )  # fmt: skip


def _loop(run: _GRPORun, train_p, val_p, total: int, r: GRPOResult, on_step) -> None:
    a, c = run.a, run.c
    P = a.batch_size // run.G  # this rank's prompts of each step's P x world
    r0 = run.group.rank * P if run.group else 0
    gens = -(-total // c.num_iterations)
    t0, n_tok = time.perf_counter(), 0
    first_gen, done_iters = divmod(r.steps, c.num_iterations)  # a resumed run's position
    try:
        step_prompts = P * run.world
        for _epoch, batches in iterate_batches(len(train_p), step_prompts, 1 << 30, a.seed, a.shuffle, first_gen, gens):
            for idx in batches:
                batch, gm = run.generate([train_p[i] for i in idx[r0 : r0 + P]], r.steps)
                old: list[np.ndarray | None] = [None] * run.n_micro
                for _ in range(min(c.num_iterations - done_iters, total - r.steps)):
                    lr = lr_at(r.steps, total, a.lr, a.lr_schedule, a.warmup, a.min_lr)
                    run.trainer.set_lr(lr)
                    t1 = time.perf_counter()
                    m = {**run.train_step(batch, old), **gm, "time/train_s": time.perf_counter() - t1}
                    r.steps += 1
                    if not math.isfinite(m["loss"]):
                        raise FloatingPointError(f"the GRPO loss is {m['loss']} at step {r.steps}")
                    n_tok += int(batch.mask.sum())
                    m["train_tokens_per_s"] = n_tok / (time.perf_counter() - t0)
                    r.losses.append(m["loss"])
                    r.metrics.append(m)
                    run.write(step=r.steps, lr=lr, **m)
                    if a.steps_per_report and r.steps % a.steps_per_report == 0 and run.main:
                        _report(r.steps, total, m, lr)
                    if a.steps_per_eval and r.steps % a.steps_per_eval == 0 and val_p:
                        r.evals.append((r.steps, run.evaluate(val_p)))
                    if a.save_every and r.steps % a.save_every == 0:
                        run.checkpoint(r)
                    if on_step is not None:
                        on_step(r.steps, m)
                done_iters = 0
                if r.steps >= total:
                    return
    except KeyboardInterrupt:
        r.interrupted = True
