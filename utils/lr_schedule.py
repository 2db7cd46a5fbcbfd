"""Learning-rate schedules: warmup, then cosine / linear / warmup-stable-decay to a floor.

Owns: the LR as a pure function of the step, so resuming needs only the step number.
"""
from __future__ import annotations

import math


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup_iters: int, decay_iters: int,
          schedule: str = "cosine", wsd_decay_frac: float = 0.2) -> float:
    """LR for optimizer step `step` (0-based).

    cosine/linear: linear warmup over `warmup_iters`, then decay to `min_lr` at `decay_iters`.
    wsd: warmup, constant at max_lr, then linear decay over the last `wsd_decay_frac` of decay_iters.
    constant: warmup then max_lr.
    """
    if schedule not in ("cosine", "linear", "wsd", "constant"):
        raise ValueError(f"unknown lr schedule {schedule!r}: cosine, linear, wsd or constant")
    if warmup_iters > 0 and step < warmup_iters:
        return max_lr * (step + 1) / warmup_iters
    if schedule == "constant":
        return max_lr
    if step >= decay_iters:
        return min_lr
    if schedule == "wsd":
        decay_start = int(decay_iters * (1.0 - wsd_decay_frac))
        if step < max(decay_start, warmup_iters):
            return max_lr
        span = max(1, decay_iters - max(decay_start, warmup_iters))
        return max_lr + (min_lr - max_lr) * (step - max(decay_start, warmup_iters)) / span
    progress = (step - warmup_iters) / max(1, decay_iters - warmup_iters)
    if schedule == "linear":
        return max_lr + (min_lr - max_lr) * progress
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)
