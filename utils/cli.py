"""One command-line convention for every command of the project.

- Flags are `--snake_case=value`; `--snake-case` is accepted too.
- Booleans are `--name=true|false` (also yes/no, on/off, 1/0); a bare `--name` means true and
  `--no_name` means false, so `--progress=false`, `--no_progress` and `--quiet` say the same thing.
- Where a command writes a directory it is `--out_dir` (`--output_dir`, the Hugging Face Trainer's
  name, is an alias).
- A name a user knows from the Hugging Face Trainer or torchtitan either works as an alias
  (`--lr`, `--max_steps`, `--output_dir`, ...) or is answered with a hint naming our flag.

Owns: the argparse helpers the commands share (the trainer's `--key=value` parser is
utils/configurator.py, which takes the same aliases and hints from here).
Must never: change what a flag means between commands.
"""
from __future__ import annotations

import argparse
import difflib
import sys
from typing import Optional, Sequence

_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}

# Names from the HF Trainer / torchtitan / nanoGPT that mean one of our trainer flags exactly.
TRAIN_ALIASES: dict[str, str] = {
    "output_dir": "out_dir",
    "lr": "learning_rate",
    "max_steps": "max_iters",
    "steps": "max_iters",                       # torchtitan training.steps
    "per_device_train_batch_size": "batch_size",
    "micro_batch_size": "batch_size",
    "seq_len": "max_seq_len",                   # torchtitan training.seq_len
    "block_size": "max_seq_len",                # nanoGPT
    "warmup_steps": "warmup_iters",
    "logging_steps": "log_interval",
    "save_steps": "checkpoint_interval",
    "eval_steps": "eval_interval",
    "save_total_limit": "keep_last",
    "max_grad_norm": "grad_clip",
    "max_norm": "grad_clip",                    # torchtitan training.max_norm
    "adam_beta1": "beta1",
    "adam_beta2": "beta2",
    "adam_epsilon": "eps",
    "lr_scheduler_type": "lr_schedule",
    "gradient_checkpointing_enable": "gradient_checkpointing",
    "torch_compile": "compile",
    "torch_compile_backend": "compile_backend",                # HF TrainingArguments
    "torch_compile_mode": "compile_mode",                      # HF TrainingArguments
    "pipeline_parallel_degree": "pipeline_parallel_size",      # torchtitan parallelism.pipeline_parallel_degree
    "pipeline_model_parallel_size": "pipeline_parallel_size",  # Megatron-LM
    "pipeline_parallel_schedule": "pipeline_schedule",         # torchtitan parallelism.pipeline_parallel_schedule
    "tensor_parallel_degree": "tensor_parallel_size",          # torchtitan parallelism.tensor_parallel_degree
    "tensor_model_parallel_size": "tensor_parallel_size",      # Megatron-LM
    "data_parallel_replicate_degree": "dp_replicate_size",     # torchtitan parallelism.data_parallel_replicate_degree
}

# Names that have no one-to-one flag: say what to write instead.
TRAIN_HINTS: dict[str, str] = {
    "bf16": "use --dtype=bf16",
    "fp16": "use --dtype=fp16 (dynamic loss scaling is on with it)",
    "resume_from_checkpoint": "not needed: the same command continues the run in --out_dir (--resume=auto); "
                              "--resume=always insists on it, --init_from=<checkpoint dir> starts a new run from one",
    "report_to": "use --wandb=true and/or --tensorboard=true",
    "model_name_or_path": "use --init_from=<Hugging Face model dir>",
    "local_rank": "not needed: rank and world size come from torchrun's environment",
    "deepspeed": "ZeRO is built in: --use_distributed_optimizer=true --zero_stage=1|2",
    "per_device_eval_batch_size": "validation uses --batch_size; --eval_iters sets how many batches",
    # the raw-input flags of the preprocessing commands: the trainer reads what they write
    **{k: "the trainer reads token shards (pretraining) or SFT/DPO records and pretokenized folders, not a Hugging "
          "Face dataset: pretokenize it first (python -m data_preprocess.pretokenize_pretrain_data --hf_dataset=... "
          "--tokenizer_dir=... --out_dir=<shards>, likewise pretokenize_sft_data / pretokenize_dpo_data), then train "
          "with --data_dir=<that folder>" for k in ("hf_dataset", "hf_split", "hf_data_files")},
    "text_fields": "the trainer reads token shards; --text_fields belongs to the pretokenizer "
                   "(python -m data_preprocess.pretokenize_pretrain_data)",
}

# The same idea for the argparse commands (tokenizer, preprocessing, export, sampling).
COMMON_ALIASES: dict[str, str] = {"output_dir": "out_dir"}


def parse_bool(value: object) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def add_bool(p: argparse.ArgumentParser, name: str, default: bool, help: str,
             false_aliases: Sequence[str] = ()) -> None:
    """`--name[=true|false]`, `--no_name`, and any extra spellings that mean false (`--quiet`)."""
    p.add_argument(f"--{name}", type=parse_bool, nargs="?", const=True, default=default,
                   metavar="true|false", help=f"{help} (default {str(default).lower()})")
    for alias in (f"no_{name}", *false_aliases):
        p.add_argument(f"--{alias}", dest=name, action="store_false", help=argparse.SUPPRESS)


def add_out_dir(p: argparse.ArgumentParser, help: str, required: bool = False, default: Optional[str] = None) -> None:
    p.add_argument("--out_dir", "--output_dir", dest="out_dir", required=required, default=default,
                   help=f"{help} (--output_dir is an alias)")


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help shows each option's default, as ArgumentDefaultsHelpFormatter does, except where there is
    none to show (required options, None, help that already says it); descriptions keep their lines."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.required or action.default is None or action.default is argparse.SUPPRESS
                or not action.option_strings or "%(default)" in text or "default" in text.lower()
                or action.default == []):
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """argparse with the project's conventions: no prefix guessing, `--a-b` == `--a_b`, unknown
    flags answered with our name for them (HF Trainer / torchtitan names) or the closest match, and
    defaults shown in --help."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):  # an option without help still shows its default
        if kwargs.get("default") is not None and not kwargs.get("required") and kwargs.get("help") is None:
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)

    def _known(self) -> set[str]:
        return {s[2:] for a in self._actions for s in a.option_strings if s.startswith("--")}

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace=None):  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        argv = [_snake(a) for a in argv]
        ns, unknown = self.parse_known_args(argv, namespace)
        if unknown:
            self.error("; ".join(unknown_flag_message(u, self._known(), {}) for u in unknown))
        return ns


def _snake(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    key, eq, val = arg[2:].partition("=")
    return "--" + key.replace("-", "_") + eq + val


def unknown_flag_message(arg: str, known: set[str] | Sequence[str], aliases: dict[str, str],
                         hints: Optional[dict[str, str]] = None) -> str:
    """`unknown flag --x`, plus what to write instead."""
    if not arg.startswith("--"):
        return f"unexpected argument {arg!r}"
    key = arg[2:].split("=", 1)[0].replace("-", "_")
    hints = TRAIN_HINTS if hints is None else hints
    if key in hints:
        return f"unknown flag --{key}: {hints[key]}"
    target = aliases.get(key) or TRAIN_ALIASES.get(key)
    if target and target in known:
        return f"unknown flag --{key}: did you mean --{target}?"
    close = difflib.get_close_matches(key, list(known), n=2, cutoff=0.6)
    return f"unknown flag --{key}" + (f": did you mean {' or '.join('--' + c for c in close)}?" if close else
                                      " (--help lists every flag)")
