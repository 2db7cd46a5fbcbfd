"""The training tasks, by --task_type. Adding one: a module with a `Task` subclass (trainer/tasks/base.py) and its
line in TASKS. Torch-free: the trainer's pre-check reads the names; a task's module is imported when a run uses it."""
from __future__ import annotations

import importlib
from typing import Any

TASKS: dict[str, str] = {  # --task_type -> "module:class"
    "pretrain": "trainer.tasks.pretrain:PretrainTask",
    "sft": "trainer.tasks.sft:SFTTask",
    "dpo": "trainer.tasks.dpo:DPOTask",
    "grpo": "trainer.tasks.grpo:GRPOTask",
}


def task_class(name: str) -> Any:
    """The Task subclass registered as `name` (ValueError naming the known ones otherwise)."""
    if name not in TASKS:
        raise ValueError(f"--task_type={name!r}: expected {' | '.join(TASKS)}")
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def get_task(cfg: Any) -> Any:
    """The task of `cfg.task_type`, built on the run's configuration."""
    return task_class(cfg.task_type)(cfg)
