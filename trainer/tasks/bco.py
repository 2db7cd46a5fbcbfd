"""BCO's reward shift (Binary Classifier Optimization, Jung et al. 2024; TRL's `RunningMoments`): delta, the running
mean of the implicit rewards, which DPO's bco_pair and KTO's bco losses subtract before their sigmoid.

Owns: `BCORunningMean`, a stateful part of a task (trainer/tasks/base.py Task.stateful): updated after each step from
the step's summed statistics, saved in trainer_state.json, restored on resume.
Must never: read the device inside a step (the sums stay there until a save reads them).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from utils.constants import EXIT_BAD_CHECKPOINT
from utils.errors import TrainingError


class BCORunningMean:
    """delta: the mean of the rewards over every item (a pair's (a + b) / 2, or an example's reward) of the steps
    before this one, all ranks, and the micro-batch's own, which TRL's also counts (one process with one micro-batch a
    step draws TRL's delta). `reward_keys`: the task's statistics whose step sums, times `scale`, are the step's reward
    sum. The sums live on the device (a step whose rewards are not finite left out) and in trainer_state.json (read at
    a save), so a resume continues them exactly, and two ranks of a micro-batch each give one process accumulating the
    same two."""

    def __init__(self, reward_keys: Sequence[str], scale: float = 1.0) -> None:
        self.reward_keys, self.scale = tuple(reward_keys), float(scale)
        self.total: Optional[torch.Tensor] = None  # float64 on the device: the rewards' sum, and the items counted
        self.count: Optional[torch.Tensor] = None
        self._saved = (0.0, 0.0)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.total is None or self.total.device != device:
            t, n = self._saved if self.total is None else (float(self.total), float(self.count))
            self.total, self.count = (torch.tensor(v, dtype=torch.float64, device=device) for v in (t, n))
        return self.total, self.count

    def delta(self, reward_sum: torch.Tensor, items: int) -> torch.Tensor:
        """delta for a micro-batch of `items` whose rewards sum to `reward_sum`."""
        total, n = self._on(reward_sum.device)
        return ((total + reward_sum.double()) / (n + items)).to(reward_sum.dtype)

    def update(self, reward_sum: torch.Tensor, items: float) -> None:
        """Add a step's reward sum over its `items`, unless it is not finite."""
        total, n = self._on(reward_sum.device)
        ok = torch.isfinite(reward_sum)
        self.total = torch.where(ok, total + reward_sum, total)
        self.count = torch.where(ok, n + items, n)

    def after_step(self, step_sums: torch.Tensor, stat_keys: Sequence[str], global_units: float) -> None:
        """Task.after_step: the step's reward sum over every rank from its statistics row (loss, stat_keys, units)."""
        rewards = sum(step_sums[1 + list(stat_keys).index(k)] for k in self.reward_keys) * self.scale
        self.update(rewards, global_units)

    def state_dict(self) -> dict:
        t, n = self._saved if self.total is None else (float(self.total), float(self.count))
        return {"reward_sum": t, "count": n}

    def load_state_dict(self, state: Any, where: str) -> None:
        try:
            t, n = float(state["reward_sum"]), float(state["count"])
        except (TypeError, KeyError, ValueError) as e:
            raise TrainingError(f"{where}: task.bco is not {{reward_sum, count}} ({e!r})", EXIT_BAD_CHECKPOINT) from e
        if not (math.isfinite(t) and math.isfinite(n) and n >= 0):
            raise TrainingError(f"{where}: task.bco {state!r} is not a finite sum over a count >= 0",
                                EXIT_BAD_CHECKPOINT)
        self.total = self.count = None
        self._saved = (t, n)
