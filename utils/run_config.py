"""A resumed run's configuration against the one it saved: rebuilding it from the saved JSON (never
executed), naming every value the command line changed, and refusing the changes that would break an
exact resume (the model's shape, the sequence length, the global batch, the data, unless allowed).
Which saved configuration a resume starts from, and which checkpoint `latest`, `best` or `step_N`
means, are checkpoint/select.py's (it reads the checkpoints).
Must never: exec a saved file, or silently drop a saved value that the current code still knows.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Callable, Optional, TypeVar

from utils.configurator import coerce_value

T = TypeVar("T")

# Changing these on resume gives another model or another data stream: the checkpoint would not
# continue the run it came from. Each maps to why.
MODEL_SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "multiple_of", "vocab_size",
                    "rope_theta", "tie_embeddings", "lora_rank", "lora_targets", "lora_train_embeddings", "trainable",
                    "mtp_num_layers", "rope_scaling", "qkv_bias", "head_dim", "qk_norm",
                    "sliding_window", "o_bias", "attn_sinks")
SEQ_KEYS = ("max_seq_len",)
DATA_KEYS = ("task_type", "data_dir", "data_mix", "tokenizer_dir", "seed", "val_ratio", "sft_packing",
             "chat_template_kwargs")  # (the last: GRPO's prompts, re-encoded on resume)
# LoRA's scale alpha / r multiplies what the adapters learned: another alpha is another model.
LORA_SCALE_KEYS = ("lora_alpha",)
# Directories: `shards/`, `shards` and its absolute path name the same data.
PATH_KEYS = ("data_dir", "tokenizer_dir", "out_dir", "ref_model")
# Where the run came from is history, not a setting to re-apply: a resume keeps --init_from=resume.
NOT_RESTORED = ("init_from",)


def config_from_saved(defaults: T, saved: dict, source: str, log: Callable[[str], None] = print) -> T:
    """`defaults` with every saved value that is still a field applied (type-checked as data)."""
    types_ = typing.get_type_hints(type(defaults))  # the annotations are strings (postponed evaluation)
    fields = {f.name for f in dataclasses.fields(defaults)}
    values, dropped = {}, []
    for k, v in saved.items():
        if k in NOT_RESTORED:
            continue
        if k not in fields:
            dropped.append(k)
            continue
        values[k] = coerce_value(k, v, types_[k], source)
    if dropped:
        log(f"[resume] {source}: ignoring saved keys this version does not know: {', '.join(sorted(dropped))}")
    # a flag the saved run predates, whose default is not what that run did (BEFORE_THE_FLAG): what it did
    for k, v in getattr(type(defaults), "BEFORE_THE_FLAG", {}).items():
        if k in fields and k not in saved and getattr(defaults, k) != v:
            values[k] = v
            log(f"[resume] {source} predates --{k}: {k}={v!r}, as that run ran")
    return dataclasses.replace(defaults, **values)


def same_value(key: str, a: Any, b: Any) -> bool:
    """Equal settings; directory flags compare as normalised absolute paths (a trailing slash, `./`
    or an absolute spelling of the same directory is not a change)."""
    if key in PATH_KEYS and isinstance(a, str) and isinstance(b, str) and a and b:
        return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))
    return a == b


def changed_values(old: Any, new: Any) -> dict[str, tuple[Any, Any]]:
    """field -> (old, new) for every field that differs."""
    out = {}
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if not same_value(f.name, a, b):
            out[f.name] = (a, b)
    return out


def resume_problems(changes: dict[str, tuple[Any, Any]], allow_data_change: bool) -> list[str]:
    """The changes that would make the resumed run not the run that was saved."""
    out = []
    for k, (a, b) in changes.items():
        if k in MODEL_SHAPE_KEYS:
            out.append(f"--{k}={b!r} (the run used {a!r}): the model's shape is fixed by its checkpoint")
        elif k in LORA_SCALE_KEYS:
            out.append(f"--{k}={b!r} (the run used {a!r}): it scales what the adapters were trained to; the "
                       "resumed model would not be the saved one")
        elif k in SEQ_KEYS:
            out.append(f"--{k}={b!r} (the run used {a!r}): the data index and the position of every sample "
                       "depend on it")
        elif k in DATA_KEYS and not allow_data_change:
            out.append(f"--{k}={b!r} (the run used {a!r}): the resumed data order would not continue the run; "
                       "pass --allow_data_change=true to train on with the new data")
    return out


def global_batch_problem(saved: dict, new_batch: int, new_accum: int, old_dp: int, new_dp: int) -> Optional[str]:
    """The samples per optimizer step must stay equal for the data cursor and schedule to continue.
    Data-parallel ranks count, not processes (the caller asks the layout how many read their own batch:
    parallel/config.py `data_parallel_size`)."""
    old = int(saved.get("batch_size", 0)) * int(saved.get("gradient_accumulation_steps", 1)) * old_dp
    new = new_batch * new_accum * new_dp
    if old and old != new:
        return (f"the global batch changed: the run used --batch_size={saved.get('batch_size')} x "
                f"--gradient_accumulation_steps={saved.get('gradient_accumulation_steps', 1)} x "
                f"{old_dp} data-parallel ranks = {old} samples per step, this resume has {new_batch} x "
                f"{new_accum} x {new_dp} = {new}; keep the product equal (e.g. halve --batch_size when "
                "doubling the processes)")
    return None
