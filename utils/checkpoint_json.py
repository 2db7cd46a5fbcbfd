"""The JSON sidecars of a checkpoint (trainer_state.json, model_config.json, config.json, pipeline.json): their
shape, checked where they are read, and their atomic writing. Torch-free, below every package: model/config.py
reads a checkpoint's model_config.json through it, the commands' pre-checks read it before torch, and the
checkpoint package (checkpoint/) writes and verifies the rest of a checkpoint with it.

Owns: what each sidecar must hold for a reader to rely on it (`trainer_state_problem`, `pipeline_meta_problem`,
`read_checkpoint_json`, `read_trainer_state`), raising CheckpointError naming the file.
Must never: import torch or a package above utils/, or read a tensor file (checkpoint/ does).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

from utils.checkpoint_layout import MODEL_CONFIG, PIPELINE_META, RUN_CONFIG, TRAINER_STATE
from utils.constants import MAX_STEPS
from utils.errors import CheckpointError, one_line
from utils.model_bounds import bound_problems
from utils.publish import atomic_write_json


def write_json(path: str, obj: Any) -> None:
    """The checkpoint JSON files (indent 2, sorted keys, UTF-8, final newline), written atomically."""
    atomic_write_json(path, obj)


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)

def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def json_problem(path: str) -> tuple[Any, Optional[str]]:
    """(the parsed JSON of `path`, None) or (None, why it cannot be read), naming the file."""
    name = os.path.basename(path)
    try:
        return read_json(path), None
    except UnicodeDecodeError:
        return None, f"{name} is not UTF-8 text"
    except ValueError as e:
        return None, f"{name} is not valid JSON ({one_line(e)[:160]})"
    except OSError as e:
        return None, f"{name} cannot be read ({one_line(e)[:160]})"



# JSON sidecars every reader parses (SIDECARS): each must be a JSON object; trainer_state.json also records the
# step and the world size of the save (the checkpoint protocol; the rest is checked where it is read).
MAX_WORLD = 10 ** 6  # ranks a checkpoint may record having been saved by


def trainer_state_problem(state: Any, required: tuple[str, ...] = ()) -> Optional[str]:
    """None when a parsed trainer_state.json has the shape every reader relies on, else the reason.
    The step and world size are checked when present (a library caller of save_dcp_checkpoint may
    write its own sidecar), and must be there when named in `required` (the trainer's resume)."""
    if not isinstance(state, dict):
        return f"{TRAINER_STATE} holds a {type(state).__name__}, not a JSON object"
    # bounded: "step": 10**30 would end the run at once as "done"; no run takes more than MAX_STEPS steps,
    # and no world has more than MAX_WORLD ranks
    for key, low, high in (("step", 0, MAX_STEPS), ("world_size", 1, MAX_WORLD), ("data_step", 0, 2 * MAX_STEPS)):
        v = state.get(key)
        if (key in state or key in required) and (not is_int(v) or not low <= v <= high):
            return f"{TRAINER_STATE}: {key}={v!r} is not an integer in [{low}, {high}]"
    v = state.get("tokens_seen")
    if v is not None and not isinstance(v, bool) and isinstance(v, (int, float)) and not 0 <= v < 1e30:
        return f"{TRAINER_STATE}: tokens_seen={v!r} is not a count of tokens (0 <= n < 1e30)"
    for key in ("val_loss", "best_val_loss"):
        v = state.get(key)
        if isinstance(v, float) and not math.isfinite(v):
            return f"{TRAINER_STATE}: {key}={v!r} is not a finite number"
    for key, types_ in (("init_info", dict), ("lora_base", dict), ("data_cursor", dict),
                        ("val_loss", (int, float)), ("best_val_loss", (int, float)), ("tokens_seen", (int, float))):
        v = state.get(key)
        if v is not None and (not isinstance(v, types_) or isinstance(v, bool)):
            return f"{TRAINER_STATE}: {key}={v!r} is not a {getattr(types_, '__name__', 'number')}"
    for key in ("init_info", "lora_base"):
        sub = state.get(key)
        if isinstance(sub, dict) and not isinstance(sub.get("source"), str):
            return f"{TRAINER_STATE}: {key} records no source path"
    if isinstance(state.get("lora_base"), dict) and not isinstance(state["lora_base"].get("fingerprint"), str):
        return f"{TRAINER_STATE}: lora_base records no fingerprint"
    return None


PIPELINE_DP_ENGINES = ("ddp", "fsdp")  # the values pipeline.json's dp_engine field may hold


def pipeline_meta_problem(meta: Any) -> Optional[str]:
    """None when a parsed pipeline.json (parallel/pipeline.py's META_FILE) has the fields a resume and a merge
    read: pp_size, dp_size, n_layers integers >= 1, layer_ranges [start, end) pairs, dp_engine ddp or fsdp."""
    if not isinstance(meta, dict):
        return f"{PIPELINE_META} holds a {type(meta).__name__}, not a JSON object"
    for key in ("pp_size", "dp_size", "n_layers"):
        v = meta.get(key)
        if not is_int(v) or not 1 <= v <= MAX_WORLD:
            return f"{PIPELINE_META}: {key}={v!r} is not an integer >= 1"
    for key in ("tp_size", "optimizer_files"):  # (optional: older checkpoints have neither)
        if key in meta and (not is_int(meta[key]) or not 1 <= meta[key] <= MAX_WORLD):
            return f"{PIPELINE_META}: {key}={meta[key]!r} is not an integer >= 1"
    ranges = meta.get("layer_ranges")
    if not isinstance(ranges, list) or len(ranges) != meta["pp_size"] or not all(
            isinstance(r, list) and len(r) == 2 and all(is_int(x) for x in r) and 0 <= r[0] <= r[1] for r in ranges):
        return f"{PIPELINE_META}: layer_ranges={ranges!r} is not one [start, end) pair of layers per stage"
    if meta.get("dp_engine", "ddp") not in PIPELINE_DP_ENGINES:
        return f"{PIPELINE_META}: dp_engine={meta.get('dp_engine')!r} is not ddp or fsdp"
    return None


def read_checkpoint_json(ckpt_dir: str, name: str) -> dict:
    """A JSON object sidecar of a checkpoint (config.json, model_config.json, trainer_state.json);
    CheckpointError naming the file when it is missing, not JSON or not an object, or (model_config.json)
    a size field is out of utils/model_bounds.py's bounds."""
    data, problem = json_problem(os.path.join(ckpt_dir, name))
    if problem is None and not isinstance(data, dict):
        problem = f"{name} holds a {type(data).__name__}, not a JSON object"
    if problem is None and name == TRAINER_STATE:
        problem = trainer_state_problem(data)
    if problem is None and name == MODEL_CONFIG:  # "n_layers": 1000000 would build layers until OOM
        bounds = bound_problems(data)
        problem = f"{MODEL_CONFIG}: {'; '.join(bounds)}" if bounds else None
    if problem:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {problem}")
    return data


def recorded_tokenizer(ckpt_dir: str) -> Optional[str]:
    """The --tokenizer_dir the run of checkpoint `ckpt_dir` recorded (its config.json), or None (no record, or no
    path in it)."""
    if not os.path.exists(os.path.join(ckpt_dir, RUN_CONFIG)):
        return None
    tok = read_checkpoint_json(ckpt_dir, RUN_CONFIG).get("tokenizer_dir")
    return tok if isinstance(tok, str) and tok else None


def read_trainer_state(ckpt_dir: str, required: tuple[str, ...] = ()) -> dict:
    """trainer_state.json of a checkpoint, its shape checked; `required`: keys that must be there
    (the trainer's resume needs step and world_size). CheckpointError naming the file otherwise."""
    state = read_checkpoint_json(ckpt_dir, TRAINER_STATE)
    problem = trainer_state_problem(state, required)
    if problem:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {problem}")
    return state

