"""What a training task is: the one interface the trainer's loop, the engines' step rows and the metrics read, so that
adding a task is one module here and one registration line (trainer/tasks/__init__.py).

Owns: `Task` (its data, the loss of one micro-batch, what the loss is averaged over, the statistics it logs, what
it needs from the run) and `TaskData` (what `datasets` returns).
Must never: branch on the engine (parallel/engine.py hides it), or read a device value per micro-batch (statistics
stay on the device as sums; the loop reads a step's row once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch

from utils.constants import IGNORE_INDEX
from utils.device import to_device


@dataclass
class TaskData:
    """A task's datasets: `train` and `val` (index -> sample), the collate function (None: stack), the unit a
    sample is counted in for the start's [data] line, where validation came from, and what to do when it is small."""
    train: Any
    val: Any
    collate: Optional[Callable] = None
    unit: str = "samples"
    val_from: str = ""
    more: str = ""


def lm_inputs(batch: dict, device: Any) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(input_ids, labels, {attention_mask, position_ids where the batch has them}) of a language-model batch on
    `device` (pinned host tensors move asynchronously)."""
    x, y = to_device(batch["input_ids"], device), to_device(batch["labels"], device)
    return x, y, {k: to_device(batch[k], device) for k in ("attention_mask", "position_ids") if k in batch}


class Task:
    """One kind of training (pretrain, SFT, DPO, ...). Subclasses set the class attributes and `datasets`; the
    defaults are a language-model loss over the batch's labels, summed over target tokens."""
    name: ClassVar[str] = ""
    units: ClassVar[str] = "target tokens"      # what a loss is averaged over, across micro-batches and ranks
    stat_keys: ClassVar[tuple] = ()             # the statistics micro_batch_loss sums beside the loss (logged)
    val_stat_keys: ClassVar[tuple] = ()         # of those, the ones validation reports as val_<key>
    needs_reference: ClassVar[bool] = False     # a frozen reference model (DPO's), loaded from the initial weights
    chat: ClassVar[bool] = False                # the model learns replies: --sample_prompts are user turns

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    def datasets(self, tok_meta: dict, val_ratio: float, fixed_shape: bool,
                 log: Optional[Callable[[str], None]]) -> TaskData:
        raise NotImplementedError

    def reference_problem(self, model_cfg: Any, ref_cfg: Any, vocab: int = 0) -> Optional[str]:
        """Why the loaded reference model (ModelConfig `ref_cfg`) cannot serve this task's model (`model_cfg`) on
        data of a tokenizer of `vocab` ids, one line (exit 2), or None. The default: a language model with a row for
        every id of the tokenizer (it scores the data's tokens)."""
        if ref_cfg.num_labels or ref_cfg.vocab_size < vocab:
            return (f"--ref_model has {ref_cfg.num_labels or ref_cfg.vocab_size} outputs and the tokenizer {vocab} "
                    "ids: the reference scores the data's tokens with a language model's head over that vocabulary")
        return None

    def before_step(self, loop: Any, draw: Callable[[], tuple]) -> tuple[list, list]:
        """The phase before a step: (this rank's micro-batches, data steps skipped). `draw()` gives the next data
        step's micro-batches (and the skipped ones); a task that makes its training rows from them (GRPO's rollouts)
        does it here, with the loop's engine, progress and metrics. Every rank must make the same number of forward
        calls here (FSDP all-gathers in forward). By default: the data drawn."""
        return draw()

    def stateful(self) -> dict:
        """The task's parts whose state moves with the steps, by name (BCO's running mean: trainer/tasks/bco.py), each
        with after_step(step_sums, stat_keys, global_units), state_dict() and load_state_dict(state, where). None by
        default."""
        return {}

    def after_step(self, step_sums: torch.Tensor, stat_keys: Sequence[str], global_units: float) -> None:
        """After a step's forwards and backwards: `step_sums` its statistics summed over the data-parallel ranks (a
        float64 row on the device, parallel/engine.py stat_row's order: loss, stat_keys, units; every rank holds the
        same), `global_units` its units (host). Each stateful part updates itself, on the device, without reading."""
        for part in self.stateful().values():
            part.after_step(step_sums, stat_keys, global_units)

    def state_dict(self) -> Optional[dict]:
        """The stateful parts' state for trainer_state.json (plain JSON numbers; read on the host at a save), or None
        without any."""
        return {name: part.state_dict() for name, part in self.stateful().items()} or None

    def load_state_dict(self, state: dict, where: str) -> None:
        """Restore `state_dict()`'s value saved in `where` (a checkpoint's trainer_state.json); a TrainingError naming
        it when it is not what this task saves."""
        for name, part in self.stateful().items():
            if name in state:
                part.load_state_dict(state[name], where)

    def steps_per_draw(self) -> int:
        """How many optimizer steps train on each data step's batches (`before_step` draws every that many
        steps): an epoch is that many times the data steps (trainer/config.py max_iters_for_epochs)."""
        return 1

    def micro_batch_loss(self, model: Any, ref_model: Any, batch: dict, device: Any) -> tuple[torch.Tensor, dict]:
        """(sum of the per-unit losses of this micro-batch, {stat key: its sum}); the caller divides by the step's
        units over all micro-batches and ranks, so that every unit weighs the same."""
        x, y, kw = lm_inputs(batch, device)
        return model(x, labels=y, reduction="sum", **kw), {}

    def evaluate(self, engine: Any, val: Any, info: Any) -> Optional[dict]:
        """The task's own validation of `val` (its TaskData.val), on every rank at each evaluation, the same
        {"val_<name>": value} on every rank; None (the default): the mean loss of --eval_iters validation batches
        (trainer/task.py evaluate). Without a val_loss no checkpoint is chosen as the best."""
        return None

    def count_units(self, batch: dict) -> int:
        """The units of a host batch (no device read)."""
        return int((batch["labels"] != IGNORE_INDEX).sum())

    def tokens_seen(self, units: float, tokens: float) -> int:
        """What a step adds to tokens_seen: by default its units (target tokens)."""
        return int(units)

    def step_metrics(self, per_unit: dict) -> dict:
        """The statistics of a step's metrics row, from its per-unit sums (the loss is added by the loop)."""
        return {k: per_unit[k] for k in self.stat_keys}
