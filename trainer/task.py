"""The trainer's side of a task (trainer/tasks/: each task's data, micro-batch loss, units and statistics): the
loaders of a task's data, the loss function an engine calls, the validation pass. The loop (trainer/loop.py) is
the same for every task and asks this module and the task object.

Owns: `build_data` (train loader + a maker of validation loaders, the [data] lines), `task_of` (the run's task
object: its micro-batch loss and units, for the engines), `count_tokens` (from the host batch: no device read), `evaluate`
(mean validation loss over every data-parallel rank, and the task's validation statistics).
Must never: branch on the engine (parallel/engine.py hides it), or on the task's name (ask the task).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from dataset.loader import ResumableLoader
from evals.lm_tasks import TaskEvaluator
from parallel.engine import StepStats
from trainer.config import TrainConfig, TrainingError, eval_task_paths
from trainer.tasks import get_task
from trainer.tasks.data import check_data_tokenizer  # noqa: F401 (re-exported: tests and callers use it here)
from utils.constants import EXIT_BAD_CONFIG, EXIT_BAD_DATA
from utils.device import is_accelerator
from utils.dist import DistInfo


MIN_VAL_SAMPLES = 20  # fewer validation samples (rows) than this: val_loss is noise, and the start warns


def task_of(cfg: TrainConfig):
    """The run's task object (exit 2 for an unknown --task_type)."""
    try:
        return get_task(cfg)
    except ValueError as e:
        raise TrainingError(str(e), EXIT_BAD_CONFIG) from e


def build_data(cfg: TrainConfig, dp_rank: int, dp_size: int, tok_meta: dict, fixed_shape: bool = False,
               log: Optional[Callable[[str], None]] = None, task=None):
    """(train_loader, make_val_loader) for the task; loaders yield dicts of tensors.

    dp_rank / dp_size: this rank's data-parallel coordinates (the engine's: the ranks of one pipeline
    read the same batches). fixed_shape: every batch is [batch_size, max_seq_len] (pipeline stages
    exchange fixed-shape activations): SFT rows are padded to max_seq_len, validation batches are
    batch_size rows. --eval_data_dir: validation is read from there (all of it) instead of a split of
    --data_dir. `log` (rank 0's) gets what was read (SFT / DPO), the split's sizes, and a warning when
    validation has fewer than MIN_VAL_SAMPLES samples."""
    val_ratio = 0.0 if cfg.eval_data_dir else cfg.val_ratio  # a separate validation set: all of --data_dir trains
    d = (task or task_of(cfg)).datasets(tok_meta, val_ratio, fixed_shape, log)
    train, val, collate, unit, val_from, more = d.train, d.val, d.collate, d.unit, d.val_from, d.more
    if log is not None:
        log(f"[data] {cfg.task_type}: {len(train)} training / {len(val)} validation {unit} (validation: {val_from})")
        if 0 < len(val) < MIN_VAL_SAMPLES:
            log(f"[warning] data: only {len(val)} validation {unit} ({val_from}): a val_loss over fewer than "
                f"{MIN_VAL_SAMPLES} is noise; {more}")
    per_step = cfg.batch_size * dp_size * cfg.gradient_accumulation_steps  # samples per optimizer step
    if len(train) < per_step:
        raise TrainingError(f"{cfg.data_dir}: {len(train)} training samples, fewer than one global batch "
                            f"({cfg.batch_size} x {dp_size} data-parallel ranks x {cfg.gradient_accumulation_steps} "
                            "accumulation steps)", EXIT_BAD_DATA)
    # the cursor counts samples of G = per_step: any (ranks, batch, accumulation) with the same G resumes it
    train_loader = ResumableLoader(train, cfg.batch_size, cfg.seed, dp_rank, dp_size,
                                   collate_fn=collate, shuffle=True, samples_per_step=per_step)

    def make_val_loader():
        if len(val) < (cfg.batch_size if fixed_shape else 1) * dp_size:
            return None
        bs = cfg.batch_size if fixed_shape else max(1, min(cfg.batch_size, len(val) // dp_size))
        return ResumableLoader(val, bs, cfg.seed, dp_rank, dp_size, collate_fn=collate, shuffle=False)

    return train_loader, make_val_loader


def prefetch_depth(cfg: TrainConfig, device) -> int:
    """Training batches drawn ahead (--prefetch_batches; -1 = 2 on an accelerator, 0 on the CPU)."""
    if cfg.prefetch_batches >= 0:
        return cfg.prefetch_batches
    return 2 if is_accelerator(device) else 0


# ---------------------------------------------------------------------------- one micro-batch

def count_tokens(batch: dict) -> int:
    """Real tokens the policy model reads in this micro-batch, for tokens/s and MFU: padding (attention_mask
    0, on the host here) is not counted; without a mask every position is a token."""
    n = 0
    for k, v in batch.items():
        if k.endswith("input_ids"):
            mask = batch.get(k[:-len("input_ids")] + "attention_mask")
            n += int(mask.sum()) if mask is not None else int(v.numel())
    return n


@torch.no_grad()
def evaluate(cfg: TrainConfig, engine, ref_model, make_val_loader, info: DistInfo, task=None) -> Optional[dict]:
    """Mean validation loss over all data-parallel ranks: all-reduce of loss sums and unit counts.
    Reads --eval_iters batches (rounded up to whole groups when the engine runs them in groups: a
    pipeline's micro-batches), or one pass over the split when that is shorter. A task with its own
    validation (Task.evaluate: GRPO's greedy rewards) gives its values instead. `task`: the run's task object
    (default: a new one)."""
    loader = make_val_loader()
    if loader is None:
        return None
    task = task if task is not None else task_of(cfg)
    own = task.evaluate(engine, loader.dataset, info)
    if own is not None:
        return own
    group = engine.micro_batches_per_call
    batches: list = []
    it = iter(loader)
    while len(batches) < -(-cfg.eval_iters // group) * group:
        batches.append(next(it))
        if loader.state_dict().get("epoch", 0) > 0 and len(batches) % group == 0:  # one pass is enough
            break
    sums = engine.evaluate(batches, lambda model, batch: task.micro_batch_loss(model, ref_model, batch, info.device),
                           task.count_units)
    per_unit = StepStats.from_tensor(engine.sum_over_data(sums, info.device), engine.stat_keys).per_unit()
    return {"val_loss": per_unit["loss"], **{f"val_{k}": per_unit[k] for k in task.val_stat_keys}}


def values_text(values: dict) -> str:
    """`key 0.1234, ...` of a row's numbers (the final line of a run without a validation loss, --eval_on_start's)."""
    return ", ".join(f"{k} {v:.4f}" for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool))


def evaluate_start(loop) -> dict:
    """--eval_on_start: the validation values of the starting weights of `loop` (trainer/loop.py Loop) and
    --eval_tasks' scores (rank 0), logged in one line. Not a candidate for the best checkpoint or the early stop: no
    checkpoint holds step 0."""
    values = evaluate(loop.cfg, loop.engine, loop.ref_model, loop.make_val_loader, loop.info, loop.task) or {}
    if loop.task_eval is not None:  # rank 0, the whole model (validate_config refuses fsdp / pipeline)
        values.update(loop.task_eval.run(loop.engine.module, loop.info.device))
    loop.log("[eval] step 0 (--eval_on_start): " + values_text(values))
    return values


def build_task_evaluator(cfg: TrainConfig):
    """--eval_tasks: the task files read, checked and encoded (exit 3 naming file:line, exit 2 for a path that is
    no task file or a choice longer than --max_seq_len), the run's tokenizer; else None."""
    paths = eval_task_paths(cfg)
    if not paths:
        return None
    # --batch_size requests per forward: a batch that fits a training step fits a no-grad forward
    return TaskEvaluator(paths, cfg.tokenizer_dir, cfg.max_seq_len, cfg.eval_tasks_limit, batch_size=cfg.batch_size)
