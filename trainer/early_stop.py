"""Early stopping (--early_stopping_patience; Hugging Face's EarlyStoppingCallback): the run ends, saved, once that
many evaluations in a row have not improved the best validation score by more than --early_stopping_threshold.

Owns: `EarlyStopping` (the best score, its step, the evaluations since; saved in every checkpoint's trainer_state.json,
so a resumed run counts on where it stopped, and a run that stopped early and is run again has nothing left to train).
The score is what `best` means for a checkpoint (checkpoint/verify.py selection_score): the validation loss, else a
task's held-out reward (GRPO's), lower being better after its sign; the same on every rank (evaluation's values are).
Must never: decide from one rank's values, or count a step without an evaluation.
"""
from __future__ import annotations

from typing import Optional

from checkpoint.verify import selection_score


class EarlyStopping:
    """patience 0: off (it counts, and is never due)."""

    def __init__(self, patience: int, threshold: float = 0.0, saved: Optional[dict] = None) -> None:
        self.patience, self.threshold = int(patience), float(threshold)
        self.best: Optional[float] = None  # lower is better (selection_score's sign)
        self.best_words, self.best_step, self.stale = "", 0, 0
        if saved:
            self.load_state_dict(saved)

    @property
    def due(self) -> bool:
        return self.patience > 0 and self.stale >= self.patience

    def update(self, evaluated: dict, step: int) -> bool:
        """Count one evaluation's values ({"val_loss": ..} or {"val_reward": ..}); whether the run stops now."""
        scored = selection_score(evaluated)
        if scored is None:  # (no validation value: nothing to judge)
            return self.due
        score, words = scored
        if self.best is None or score < self.best - self.threshold:
            self.best, self.best_words, self.best_step, self.stale = score, words, step, 0
        else:
            self.stale += 1
        return self.due

    def describe(self) -> str:
        return (f"{self.stale} evaluation(s) without an improvement of more than {self.threshold:g} on the best, "
                f"{self.best_words} at step {self.best_step}")

    def state_dict(self) -> dict:
        return {"best": self.best, "best_words": self.best_words, "best_step": self.best_step, "stale": self.stale}

    def load_state_dict(self, state: dict) -> None:
        self.best = None if state.get("best") is None else float(state["best"])
        self.best_words, self.best_step = str(state.get("best_words", "")), int(state.get("best_step", 0))
        self.stale = int(state.get("stale", 0))
