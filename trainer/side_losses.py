"""The losses a model's own layers add beside the task's (the engine's `side_loss`, parallel/engine.py): MoE
balancing (trainer/moe.py) and multi-token prediction (trainer/mtp.py), as one object.

Owns: `SideLosses.of` (None when the model has neither), `take(key, batch)` (the parts' terms of a micro-batch's
forwards summed, in the task's loss units), `after_step` / `read` (each part's step statistics, on their way to the
host, then as metrics-row fields).
Must never: read a device value to the host before `read`.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Optional

import torch

from trainer.moe import MoETraining
from trainer.mtp import MTPTraining


class SideLosses:
    def __init__(self, parts: list) -> None:
        self.parts = parts

    @classmethod
    def of(cls, cfg: Any, model: torch.nn.Module, count_units: Callable[[dict], int]) -> Optional["SideLosses"]:
        parts = [p for p in (MoETraining.of(cfg, model, count_units), MTPTraining.of(cfg, model)) if p is not None]
        return cls(parts) if parts else None

    def take(self, key: Optional[Hashable], batch: Optional[dict]) -> Optional[torch.Tensor]:
        total = None
        for part in self.parts:  # every part takes (and files) its statistics, whatever the others return
            extra = part.take(key, batch)
            if extra is not None:
                total = extra if total is None else total + extra
        return total

    def after_step(self, engine: Any, device: torch.device) -> list:
        return [part.after_step(engine, device) for part in self.parts]

    def read(self, copies: list) -> dict:
        rec: dict = {}
        for part, copy in zip(self.parts, copies):
            rec.update(part.read(copy))
        return rec
