"""What a run directory says about its run: the configuration a resume starts from, and which
checkpoint a command means by `latest`, `best` or `step_N`.

Owns: rebuilding a run's configuration from the JSON it saved (never executed), applying the
command line over it, naming every value that changed, and refusing the changes that would break
an exact resume (the model's shape, the sequence length, the global batch, the data, unless
allowed). Also `select_checkpoint`, used by sample.py and export_hf.py.
Must never: exec a saved file, or silently drop a saved value that the current code still knows.
"""
from __future__ import annotations

import dataclasses
import os
import re
import typing
from typing import Any, Callable, Optional, Sequence, TypeVar

from utils.configurator import ConfigError, coerce_value, parse_config
from utils import checkpoint as ckpt

T = TypeVar("T")

# Changing these on resume gives another model or another data stream: the checkpoint would not
# continue the run it came from. Each maps to why.
MODEL_SHAPE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim", "multiple_of", "vocab_size",
                    "rope_theta", "tie_embeddings", "lora_rank", "lora_targets", "lora_train_embeddings", "trainable")
SEQ_KEYS = ("max_seq_len",)
# The pipeline split fixes which stage file holds which layer, and its optimizer state: resume at the same P.
MESH_KEYS = ("pipeline_parallel_size",)
DATA_KEYS = ("task_type", "data_dir", "data_mix", "tokenizer_dir", "seed", "val_ratio", "sft_packing")
# LoRA's scale alpha / r multiplies what the adapters learned: another alpha is another model.
LORA_SCALE_KEYS = ("lora_alpha",)
# Directories: `shards/`, `shards` and its absolute path name the same data.
PATH_KEYS = ("data_dir", "tokenizer_dir", "out_dir", "ref_model")
# Where the run came from is history, not a setting to re-apply: a resume keeps --init_from=resume.
NOT_RESTORED = ("init_from",)


def saved_run_config(run_dir: str) -> tuple[Optional[dict], Optional[str]]:
    """(the configuration dict a resume should start from, the file it came from).

    The newest valid checkpoint's config.json first (it matches the weights being resumed), else
    the run directory's config.json (a run that stopped before its first checkpoint)."""
    found = ckpt.find_latest_valid(run_dir, log=lambda s: None) if os.path.isdir(run_dir) else None
    for path in ([os.path.join(found, ckpt.RUN_CONFIG)] if found else []) + [os.path.join(run_dir, ckpt.RUN_CONFIG)]:
        if os.path.isfile(path):
            try:
                data = ckpt.read_json(path)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{path}: unreadable saved configuration ({e})") from e
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: saved configuration is not a JSON object")
            return data, path
    return None, None


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
        elif k in MESH_KEYS:
            out.append(f"--{k}={b!r} (the run used {a!r}): a pipeline checkpoint resumes only at the pipeline "
                       "layout it was saved with (to change it, start a new run with --init_from=<this run>)")
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


def resolve_resume_config(defaults: T, argv: Sequence[str], run_dir: str,
                          log: Callable[[str], None] = print, allow_field: str = "allow_data_change") -> tuple[T, Optional[str]]:
    """The configuration of `--init_from=resume`: the saved run's, with argv applied over it.

    Returns (config, source file or None when the run saved nothing). Raises ConfigError naming
    each flag whose change would break the resume. Logs one line listing every changed value.
    """
    saved, source = saved_run_config(run_dir)
    fresh = parse_config(defaults, argv)
    if saved is None:
        return fresh, None
    base = config_from_saved(defaults, saved, source, log)
    cfg = parse_config(base, argv)
    changes = {k: v for k, v in changed_values(base, cfg).items() if k not in NOT_RESTORED and k != allow_field}
    problems = resume_problems(changes, bool(getattr(cfg, allow_field, False)))
    if problems:
        raise ConfigError("cannot resume " + run_dir + " with these changes: " + "; ".join(problems))
    if changes:
        log("[resume] configuration from " + source + "; changed on the command line: " +
            ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in sorted(changes.items())))
    else:
        log(f"[resume] configuration from {source} (nothing changed on the command line)")
    return cfg, source


# ---------------------------------------------------------------- choosing a checkpoint

_STEP = re.compile(r"^step_?(\d+)$")


def select_checkpoint(path: str, which: str = "latest", log: Callable[[str], None] = print) -> str:
    """A verified checkpoint directory of a run: `latest` (newest valid), `best` (lowest validation
    loss among valid ones) or `step_N` / `N`. `path` may also be a checkpoint directory itself
    (then `which` must be `latest`). Raises CheckpointError with what exists when none matches."""
    which = (which or "latest").strip()
    if os.path.isfile(os.path.join(path, ckpt.MANIFEST)) or os.path.isfile(os.path.join(path, ckpt.COMPLETE_MARKER)):
        if which != "latest":
            raise ckpt.CheckpointError(f"{path} is one checkpoint; --checkpoint={which} needs the run directory")
        found = ckpt.resolve_checkpoint_dir(path, log=log)
        assert found is not None
        return found
    all_ckpts = ckpt.list_checkpoints(path)
    names = ", ".join(os.path.basename(p) for _, p in all_ckpts) or "none"
    if which == "latest":
        found = ckpt.find_latest_valid(path, log=log)
        if found is None:
            raise ckpt.CheckpointError(f"{path}: no complete checkpoint (found: {names})")
        return found
    if which == "best":
        best, best_path = float("inf"), None
        for _, p in all_ckpts:
            if ckpt.verify_checkpoint(p) is not None:
                continue
            v = ckpt.read_json(os.path.join(p, ckpt.TRAINER_STATE)).get("val_loss")
            if isinstance(v, (int, float)) and v < best:
                best, best_path = float(v), p
        if best_path is None:
            raise ckpt.CheckpointError(f"{path}: no valid checkpoint has a validation loss (found: {names}); "
                                       "use --checkpoint=latest")
        log(f"[checkpoint] best: {best_path} (val_loss {best:.4f})")
        return best_path
    m = _STEP.match(which) or (re.match(r"^(\d+)$", which))
    if not m:
        raise ckpt.CheckpointError(f"--checkpoint={which!r}: expected latest, best or step_N")
    step = int(m.group(1))
    for s, p in all_ckpts:
        if s == step:
            problem = ckpt.verify_checkpoint(p)
            if problem:
                raise ckpt.DamagedCheckpointError(f"checkpoint {p} is not usable: {problem}")
            return p
    raise ckpt.CheckpointError(f"{path}: no checkpoint at step {step} (found: {names})")
