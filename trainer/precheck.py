"""train_my_ddp.py's pre-check: the answers that need no torch, given before torch is imported (a second, not a
minute on a busy machine), each the line and exit code the full path gives for the same mistake.

Owns: `precheck`, and the continuing run's configuration as the pre-check sees it (the saved one with the
command line over it).
Must never: import torch; read anything but the config files, tokenizer_meta.json and --eval_tasks files named
on the command line, --data_dir's and --out_dir's listing and JSON (never a checkpoint's tensors).
"""
from __future__ import annotations

import os
from typing import Optional

from trainer.config import (TrainConfig, continues_run, existing_run_error, imply_engine, init_checkpoint_problem,
                            no_weights_message, nothing_to_continue_error)
from trainer.validation import eval_tasks_content_error, run_tokenizer_meta, validate_config
from utils.constants import EXIT_BAD_CONFIG, EXIT_BAD_DATA
from utils.errors import TrainingError, one_line


def precheck(argv: list[str], title: str, prog: str) -> None:
    """train_my_ddp.py's answers that need no torch, given before it imports torch (a second, not a minute on a
    busy machine): --help (exit 0); a flag, value or config file that does not parse, a value validate_config
    refuses, a --tokenizer_dir without tokenizer_meta.json, --resume=never on an --out_dir with checkpoints,
    --resume=always with nothing to continue, and an --init_from, --resume_fallback or --ref_model path
    that is not there, an --out_dir that cannot be created or whose checkpoints/ cannot be written, a new model
    whose --dim does not split into --n_heads (exit 2), an --eval_tasks file that cannot be scored (exit 3 naming
    file:line; exit 2 for a path that is no task file), a --data_dir (or --eval_data_dir) that does not exist or
    (pretrain) holds raw text instead of token shards, with the pretokenizer's commands (exit 3,
    data_preprocess/train_data_check.py; the full path says "no token shards" without the commands), and an
    --out_dir another run holds (exit 6, utils/run_lock.py). Each is printed as the full path prints that
    mistake, with its exit code; with several mistakes the full path may name another one first. Returns when it
    finds none: the full path checks the rest (devices, what the
    checkpoints hold, the data, the FSDP / pipeline / LoRA-target options, changes a resume refuses); a bad
    value in a configuration that uses those options is left to it too, so that its one message lists every
    problem.
    Reads only --out_dir's listing and JSON, the config files, tokenizer_meta.json and --eval_tasks files named and
    --data_dir's listing; creates --out_dir and probes its lock (run.lock) last, once everything else passed."""
    import sys

    from utils.configurator import ConfigError, help_text, parse_config
    from utils.constants import EXIT_OK
    from utils.run_dir import CKPT_SUBDIR, has_run_start, listed_checkpoints

    def fail(msg: str, code: int = EXIT_BAD_CONFIG) -> None:
        print(msg, file=sys.stderr, flush=True)
        sys.exit(code)

    if any(a in ("-h", "--help") for a in argv):
        print(help_text(TrainConfig(), title, prog=prog))
        sys.exit(EXIT_OK)
    given: set[str] = set()
    try:
        cfg = parse_config(TrainConfig(), argv, given=given)
    except ConfigError as e:
        fail(f"{prog}: error: {one_line(e)}")
    imply_engine(cfg, given)
    error = f"[rank {int(os.environ.get('RANK', '0'))}] error: "
    continues = continues_run(cfg)
    if continues:  # the run's saved configuration with the command line over it, as the full path builds it
        cfg = _saved_config_under(cfg, argv)
        if cfg is None:
            return
    try:
        validate_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")), torch_free=True)
    except TrainingError as e:
        if validated_with_torch(cfg):  # the full path's one message lists those problems too: let it
            return
        fail(error + one_line(e))
    try:
        run_tokenizer_meta(cfg)
    except TrainingError as e:  # the same line and code as trainer/loop.py train
        fail(error + one_line(e), e.exit_code)
    bad_task = eval_tasks_content_error(cfg)
    if bad_task is not None:  # the line and code the full path gives (trainer/task.py build_task_evaluator)
        from utils.errors import exit_code_for
        code, msg = exit_code_for(bad_task)
        fail(error + msg, code)
    checkpoints = listed_checkpoints(cfg.out_dir)
    if not continues and cfg.init_from == "scratch":  # the model is built from these flags: do they split?
        from utils.model_bounds import head_shape_problem
        shape = head_shape_problem(cfg.dim, cfg.n_heads, cfg.n_kv_heads or None, cfg.head_dim or None)
        if shape:
            fail(error + f"bad model configuration: {shape}")  # as build_model says it, 14 s later
    from data_preprocess.train_data_check import training_data_problem
    data = training_data_problem(cfg.task_type, cfg.data_dir, cfg.tokenizer_dir, cfg.max_seq_len, cfg.data_mix)
    if data:  # missing, or raw text where token shards belong (with the commands that make them)
        fail(error + data, EXIT_BAD_DATA)
    if cfg.eval_data_dir:  # the same look at the validation data, the flag named
        data = training_data_problem(cfg.task_type, cfg.eval_data_dir, cfg.tokenizer_dir, cfg.max_seq_len)
        if data:
            fail(error + data.replace("data: ", "data: --eval_data_dir=", 1).replace(
                "then train with --data_dir=", "then pass --eval_data_dir="), EXIT_BAD_DATA)
    if continues and not checkpoints and not has_run_start(cfg.out_dir):  # --resume=always, nothing to continue
        if not cfg.resume_fallback:
            fail(error + one_line(nothing_to_continue_error(cfg, os.path.join(cfg.out_dir, CKPT_SUBDIR))))
        if cfg.resume_fallback != "scratch" and not os.path.isdir(cfg.resume_fallback):
            fail(error + no_weights_message("--resume_fallback", cfg.resume_fallback))
    if not continues:
        if checkpoints:
            fail(error + one_line(existing_run_error(cfg)))
        if cfg.init_from != "scratch" and not os.path.isdir(cfg.init_from):
            fail(error + no_weights_message("--init_from", cfg.init_from))
        choice = init_checkpoint_problem(cfg)
        if choice:
            fail(error + choice)
    if cfg.ref_model and not os.path.isdir(cfg.ref_model):  # whichever task reads it (DPO, GRPO with --beta)
        fail(error + no_weights_message("--ref_model", cfg.ref_model))
    if cfg.reward_model and not os.path.isdir(cfg.reward_model):  # (GRPO's reward model)
        fail(error + no_weights_message("--reward_model", cfg.reward_model))
    if int(os.environ.get("RANK", "0")) == 0:  # an --out_dir that cannot be made, or one another run holds
        from utils import run_lock
        from utils.errors import exit_code_for
        try:
            run_lock.acquire(cfg.out_dir, command=run_lock.command_line(argv)).release()  # main() takes it for good
            run_lock.check_run_dir_layout(cfg.out_dir)
        except run_lock.REFUSALS as e:
            code, msg = exit_code_for(e)
            print(error + msg, file=sys.stderr, flush=True)
            sys.exit(code)


def validated_with_torch(cfg: TrainConfig) -> bool:
    """Whether validate_config also checks options that need torch to tell (LoRA target names), which the
    pre-check cannot list with the others."""
    return cfg.lora_rank > 0 and cfg.lora_targets != "all"


def _saved_config_under(asked: TrainConfig, argv: list[str]) -> Optional[TrainConfig]:
    """The configuration a continuing run resolves (checkpoint.select.resolve_resume_config): the saved
    one with argv over it, --resume as asked. None when a saved value does not read back: the full
    path names that."""
    import dataclasses
    import typing

    from utils.configurator import ConfigError, coerce_value, parse_config
    from utils.run_dir import saved_config
    try:
        saved = saved_config(asked.out_dir)
    except ValueError:
        return None
    if saved is None:
        return asked
    hints = typing.get_type_hints(TrainConfig)
    values = {}
    try:
        for k, v in saved.items():
            if k in hints and k != "init_from":  # utils.run_config.NOT_RESTORED
                values[k] = coerce_value(k, v, hints[k], "saved configuration")
        cfg = parse_config(dataclasses.replace(TrainConfig(), **values), argv)
    except ConfigError:
        return None
    cfg.resume = asked.resume  # how to start is this command's choice, never the saved run's
    return cfg
