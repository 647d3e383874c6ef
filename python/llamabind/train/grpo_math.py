"""GRPO's arithmetic on the host, in float64 (issue 85): the group-normalized advantages of the rewards and the
per-token loss of TRL 1.16's GRPOTrainer (``_generate_and_score_completions``, ``_compute_loss``) with its
derivative in each token's log-probability, which the training graph multiplies with the log-probabilities
(``loss="grpo"``, python/src/preference.cpp) so that the backward pass computes TRL's gradient. numpy only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["LOSS_TYPES", "TokenLoss", "group_advantages", "token_loss"]

LOSS_TYPES = ("grpo", "dr_grpo", "bnpo", "dapo")
"""TRL's loss_type values :func:`token_loss` computes (their clipped-ratio objective and normalizations)."""


def _nanstd(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """TRL's nanstd: the standard deviation ignoring NaNs with Bessel's correction (NaN for fewer than 2 values)."""
    n = np.sum(~np.isnan(x), axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.nanmean(x, axis=axis, keepdims=True)
        var = np.nansum((x - mean) ** 2, axis=axis) / np.where(n > 1, n - 1, np.nan)
    return np.sqrt(var)


def group_advantages(
    rewards_per_func: np.ndarray, weights: np.ndarray, num_generations: int, scale_rewards: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TRL's advantages (``multi_objective_aggregation="sum_then_normalize"``).

    Args:
        rewards_per_func: float (n, k), each completion's reward from each of k functions, NaN where one
            returned None; the n completions in groups of ``num_generations`` (a prompt's, consecutive).
        weights: float (k,), the reward functions' weights.
        num_generations: completions per prompt (>= 2).
        scale_rewards: ``"group"`` (divide by the group's standard deviation + 1e-4), ``"batch"`` (by the
            batch's) or ``"none"``.

    Returns (advantages (n,), rewards (n,): the weighted sums, NaN where every function returned None,
    std (n,): the standard deviation each was divided by). A completion no function scored gets advantage 0."""
    r = np.nansum(rewards_per_func * weights[None, :], axis=1)
    r[np.isnan(rewards_per_func).all(axis=1)] = np.nan
    g = r.reshape(-1, num_generations)
    with np.errstate(invalid="ignore"):
        mean = np.repeat(np.nanmean(g, axis=1), num_generations)
    if scale_rewards == "batch":
        std = np.full_like(r, _nanstd(r) if r.size > 1 else 0.0)
    else:
        std = np.repeat(_nanstd(g, axis=1), num_generations)
    adv = r - mean
    if scale_rewards != "none":
        adv = adv / (std + 1e-4)
    return np.nan_to_num(adv, nan=0.0), r, std


@dataclass
class TokenLoss:
    """One micro-batch's GRPO loss (TRL's ``_compute_loss`` return value: divided by the gradient accumulation
    where its loss_type is), ``coef`` float64 (b, t): d loss / d logp of each token (0 where masked), ``kl``
    the masked mean per-token KL (NaN with beta 0), ``clipped``: the fractions of masked tokens whose ratio was
    clipped low (advantage < 0), high (advantage > 0) and either (TRL's clip_ratio/low_mean, high_mean,
    region_mean), ``magnitude`` the sum of the weighted per-token terms' absolute values (the scale of the loss's
    rounding: its terms cancel)."""

    loss: float
    coef: np.ndarray
    kl: float
    clipped: tuple[float, float, float]
    magnitude: float = 0.0


def token_loss(
    logp: np.ndarray,
    old: np.ndarray | None,
    ref: np.ndarray | None,
    advantages: np.ndarray,
    mask: np.ndarray,
    *,
    loss_type: str,
    beta: float,
    epsilon: float,
    epsilon_high: float,
    bias_correction_kl: bool,
    max_completion_length: int,
    n_items: float,
    grad_accum: int,
) -> TokenLoss:
    """The loss and its derivative in each token's log-probability, for one micro-batch of b completions.

    Args:
        logp: float (b, t), each completion token's log-probability under the policy being trained,
            log softmax(logits / temperature) (TRL's ``per_token_logps``).
        old: the same under the policy that sampled them (TRL's ``old_per_token_logps``); None: ``logp``
            itself (num_iterations 1: the ratio is 1, its gradient that of logp).
        ref: the reference model's (beta > 0), else None.
        advantages: float (b,).
        mask: (b, t), 1 for a completion's tokens up to and including its end-of-sequence token, 0 after
            and for truncated completions under mask_truncated_completions.
        loss_type: one of :data:`LOSS_TYPES` (TRL's normalizations: grpo, the mean over completions of each
            one's token mean; bnpo, the micro-batch's token mean; dr_grpo, the sum over b x
            max_completion_length; dapo, the sum over ``n_items``, the masked tokens of the whole generation
            batch: one optimizer step a generation batch, TRL's steps_per_generation = gradient_accumulation_steps).
        beta: the KL coefficient.
        epsilon: the ratio's clipping below, 1 - epsilon.
        epsilon_high: the ratio's clipping above, 1 + epsilon_high.
        bias_correction_kl: the KL term times the ratio (TRL's use_bias_correction_kl).
        max_completion_length: the dr_grpo normalization's length.
        n_items: the dapo normalization's token count (the generation batch's masked tokens).
        grad_accum: micro-batches per optimizer step (the grpo, bnpo and dr_grpo losses are divided by it).
    """
    mask = np.asarray(mask, np.float64)
    a = np.asarray(advantages, np.float64)[:, None]
    lr = np.zeros_like(logp) if old is None else logp - old
    c1 = np.exp(lr)
    lo, hi = 1.0 - epsilon, 1.0 + epsilon_high
    c2 = np.clip(c1, lo, hi)
    p1, p2 = c1 * a, c2 * a
    per_token = -np.minimum(p1, p2)
    d1 = a * c1  # d p1 / d logp
    d2 = np.where((c1 > lo) & (c1 < hi), a * c1, 0.0)
    # -min: the gradient of the smaller one (torch.min splits a tie evenly)
    d = -np.where(p1 < p2, d1, np.where(p1 > p2, d2, 0.5 * (d1 + d2)))
    kl = float("nan")
    if beta != 0.0:
        assert ref is not None
        e = np.exp(ref - logp)
        k = e - (ref - logp) - 1.0
        dk = 1.0 - e
        if bias_correction_kl:
            dk = dk * c1 + k * c1
            k = k * c1
        per_token = per_token + beta * k
        d = d + beta * dk
        kl = float((k * mask).sum() / max(mask.sum(), 1.0))
    b = logp.shape[0]
    if loss_type == "grpo":
        w = mask / np.maximum(mask.sum(axis=1, keepdims=True), 1.0) / b / grad_accum
    elif loss_type == "bnpo":
        w = mask / max(mask.sum(), 1.0) / grad_accum
    elif loss_type == "dr_grpo":
        w = mask / (b * max_completion_length) / grad_accum
    elif loss_type == "dapo":
        w = mask / max(n_items, 1.0)
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}; got {loss_type!r}")
    n = max(mask.sum(), 1.0)
    low = ((c1 < lo) & (a < 0)) * mask
    high = ((c1 > hi) & (a > 0)) * mask
    clipped = (float(low.sum() / n), float(high.sum() / n), float((low + high).sum() / n))
    return TokenLoss(float((per_token * w).sum()), d * w, kl, clipped, float(np.abs(per_token * w).sum()))
