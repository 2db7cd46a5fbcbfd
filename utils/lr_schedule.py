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


def schedule_warnings(*, max_iters: int, warmup_iters: int, lr_decay_iters: int, schedule: str,
                      resumed_at: int = 0, saved_max_iters: int = 0) -> list[str]:
    """What about a schedule no longer makes sense, one sentence each (the trainer logs them as
    warnings; none stops the run). lr_decay_iters: the flag (0 = decay over max_iters);
    resumed_at / saved_max_iters: the step a resume continues from and the max_iters the run had."""
    out = []
    decay = lr_decay_iters or max_iters
    if warmup_iters >= max_iters:
        out.append(f"--warmup_iters={warmup_iters} >= --max_iters={max_iters}: the run ends before the warmup does "
                   "and never trains at the peak learning rate")
    if schedule != "constant" and lr_decay_iters and lr_decay_iters <= warmup_iters:
        out.append(f"--lr_decay_iters={lr_decay_iters} <= --warmup_iters={warmup_iters}: the learning rate drops "
                   "to --min_lr right after the warmup")
    if resumed_at and saved_max_iters and saved_max_iters != max_iters and schedule != "constant":
        if not lr_decay_iters:
            out.append(f"resumed at step {resumed_at} with --max_iters {saved_max_iters} -> {max_iters}: the decay "
                       f"now spans {max_iters} steps, so the learning rate jumps from the old curve to the new one "
                       "(pin --lr_decay_iters to keep the old curve)")
        elif max_iters > decay >= resumed_at:
            out.append(f"resumed at step {resumed_at} with --max_iters={max_iters} past --lr_decay_iters={decay}: "
                       f"steps {decay + 1}-{max_iters} run at --min_lr")
        elif max_iters < decay:
            out.append(f"resumed at step {resumed_at} with --max_iters {saved_max_iters} -> {max_iters}, before "
                       f"--lr_decay_iters={decay}: the run stops before the learning rate has decayed to --min_lr")
    return out
