"""The training tasks, by --task_type. Adding one: a module with a `Task` subclass (trainer/tasks/base.py) and its
line in TASKS: "module:Class", or a TaskEntry that also names the engine capability the task needs
(parallel/config.py CAPABILITIES; an engine or a layout without it refuses the run in one line). Torch-free: the
trainer's pre-check reads the names and needs; a task's module is imported when a run uses it."""
from __future__ import annotations

import importlib
from typing import Any, NamedTuple, Union


class TaskEntry(NamedTuple):
    path: str                 # "module:Class"
    needs: str = ""           # the engine capability the task needs beyond a plain forward/backward ("" = none)
    from_pretrained: bool = False  # starts from trained weights: --init_from=scratch is refused
    tokens: tuple = ()        # the tokenizer's special tokens (tokenizer_meta.json roles) the task reads itself
    score_head: int = 0       # a reward model's: the model's head gives this many scores (model/score_head.py), not
    #                           the vocabulary's logits (0 = a language model)


TASKS: dict[str, Union[str, TaskEntry]] = {  # --task_type -> its entry
    "pretrain": "trainer.tasks.pretrain:PretrainTask",
    "sft": TaskEntry("trainer.tasks.sft:SFTTask", needs="padded_batches", from_pretrained=True, tokens=("pad",)),
    "dpo": TaskEntry("trainer.tasks.dpo:DPOTask", needs="sequence_logprobs", from_pretrained=True),
    "kto": TaskEntry("trainer.tasks.kto:KTOTask", needs="task_forwards", from_pretrained=True),  # (and DPO's)
    "reward": TaskEntry("trainer.tasks.reward:RewardTask", needs="sequence_scores", from_pretrained=True,
                        score_head=1),
    "distill": TaskEntry("trainer.tasks.distill:DistillTask", needs="token_logits", from_pretrained=True,
                         tokens=("pad",)),
    "grpo": TaskEntry("trainer.tasks.grpo:GRPOTask", needs="rollouts", tokens=("eos", "pad")),
}


def task_entry(name: str) -> TaskEntry:
    """The registration of `name` (ValueError naming the known ones otherwise)."""
    if name not in TASKS:
        raise ValueError(f"--task_type={name!r}: expected {' | '.join(TASKS)}")
    entry = TASKS[name]
    return entry if isinstance(entry, TaskEntry) else TaskEntry(entry)


def task_class(name: str) -> Any:
    """The Task subclass registered as `name` (ValueError naming the known ones otherwise)."""
    module, cls = task_entry(name).path.split(":")
    return getattr(importlib.import_module(module), cls)


def get_task(cfg: Any) -> Any:
    """The task of `cfg.task_type`, built on the run's configuration."""
    return task_class(cfg.task_type)(cfg)
