"""Learning-rate schedules: linear warmup, then constant, cosine or linear decay to ``min_lr``
(the shapes of mlx-lm's ``cosine_decay`` / ``linear_schedule`` joined to a warmup, and of
transformers' ``get_cosine_schedule_with_warmup`` with min_lr 0)."""

from __future__ import annotations

import math

from .._validate import as_float, as_int, expect, one_of

__all__ = ["SCHEDULES", "lr_at", "check_schedule"]

SCHEDULES = ("constant", "cosine", "linear")


def check_schedule(schedule: str, warmup: int, lr: float, min_lr: float) -> tuple[int, float]:
    """Validated (warmup, min_lr). ValueError for an unknown schedule, warmup < 0, or min_lr
    outside [0, lr)."""
    one_of(schedule, "lr_schedule", SCHEDULES)
    warmup = as_int(warmup, "warmup", 0)
    min_lr = as_float(min_lr, "min_lr", 0.0)
    expect(min_lr < lr, f"min_lr ({min_lr}) must be below lr ({lr})")
    return warmup, min_lr


def lr_at(step: int, total: int, lr: float, schedule: str = "constant", warmup: int = 0, min_lr: float = 0.0) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``total``: ``lr * (step + 1) /
    warmup`` during the warmup steps, then ``lr`` (constant), or from ``lr`` at the first step
    after the warmup towards ``min_lr`` at ``total`` by ``schedule`` ("cosine": half a cosine period;
    "linear"). Never
    reaches min_lr within the run, so it stays > 0 with min_lr 0."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    p = (step - warmup) / max(1, total - warmup)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * p))
    return lr + (min_lr - lr) * p
