"""What a run directory holds, read without torch: its checkpoint directories by name, its record of
how the run started, its saved configuration, and whether a directory is a Hugging Face model.

Owns: the torch-free look at `<out_dir>/checkpoints/step_N/`, `run_start.json` and `config.json` that
lets the commands answer a mistake before they import torch (train_my_ddp.py's pre-check in
trainer/config.py, sample.py and export_hf.py): a `--checkpoint=` that names nothing, a `--ckpt` that is
not there, whether `--resume=auto` continues a run. The names are utils/checkpoint_layout.py's.
Must never: import torch, verify, load or modify a checkpoint (checkpoint/ does: what exists
but may be damaged is left to it), or decide anything a checkpoint's contents would decide.
"""
from __future__ import annotations

import json
import os
import re
from typing import Optional

from utils.errors import one_line  # noqa: F401  (re-exported for the pre-checks)

# The names are utils/checkpoint_layout.py's (re-exported: the pre-checks import them from here).
from utils.checkpoint_layout import (CKPT_SUBDIR, COMPLETE_MARKER, MANIFEST, MODEL_FILE, RUN_CONFIG,  # noqa: F401
                                     RUN_START, STEP_PREFIX, TRAINER_STATE, checkpoint_root, parse_step)
from utils.constants import MAX_STEPS

_STEP = re.compile(rf"^{STEP_PREFIX.rstrip('_')}_?(\d+)$")  # `--checkpoint=step_N`, `stepN` or `N` (utils/run_config.select_checkpoint)




def misnamed_step(path: str, step: int) -> Optional[int]:
    """The step a checkpoint directory's trainer_state.json records when it is not the `step` its name says (a
    copy saved under another name), else None (they agree, or the file is missing or unreadable: verifying the
    directory names that). A misnamed directory is not one of the run's checkpoints: never loaded as the newest,
    never pruned."""
    try:
        with open(os.path.join(path, TRAINER_STATE), encoding="utf-8") as f:
            recorded = json.load(f).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(recorded, int) and not isinstance(recorded, bool) and 0 <= recorded <= MAX_STEPS and \
            recorded != step:  # a step no run can reach is damage, which verifying the directory names
        return recorded
    return None


def listed_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoints/step_N directory, newest first, unverified
    (checkpoint.verify.list_checkpoints)."""
    root = checkpoint_root(out_dir)
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [(step, os.path.join(root, n)) for n in names if (step := parse_step(n)) is not None]
    return sorted(((s, p) for s, p in found if misnamed_step(p, s) is None), reverse=True)


def misnamed_checkpoints(out_dir: str) -> list[tuple[str, int]]:
    """(path, the step its trainer_state.json records) of every checkpoints/step_N directory whose name says
    another step: left out of listed_checkpoints (never loaded as the newest, never pruned)."""
    root = checkpoint_root(out_dir)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return []
    out = []
    for n in names:
        step = parse_step(n)
        if step is not None and (recorded := misnamed_step(os.path.join(root, n), step)) is not None:
            out.append((os.path.join(root, n), recorded))
    return out


def has_run_start(out_dir: str) -> bool:
    """Whether the trainer recorded how the run started (it does before the first step)."""
    return os.path.isfile(os.path.join(out_dir, RUN_START))


def is_checkpoint_dir(path: str) -> bool:
    """One checkpoint directory (not a run directory): it has a manifest or a COMPLETE marker."""
    return os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, COMPLETE_MARKER))


# the transformers model types whose directories our model reads (model/hf_interop.py config_from_hf)
HF_MODEL_TYPES = ("llama", "mistral", "ministral3", "phi3", "qwen2", "qwen3", "smollm3", "gemma", "gemma2", "granite",
                  "seed_oss", "gemma3_text", "olmo2", "olmo3", "mixtral", "qwen3_moe", "qwen2_moe", "glm4_moe",
                  "deepseek_v3", "deepseek_v2", "kimi_k2", "gpt_oss",
                  "gemma3", "mistral3", "llava")  # (the last: vision-language checkpoints, their text model read)


def is_hf_dir(path: str) -> bool:
    """A Hugging Face Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE or GLM-4-MoE directory: config.json with one of
    HF_MODEL_TYPES, and
    safetensors."""
    cfg_path = os.path.join(path, RUN_CONFIG)  # HF's config.json: the same name
    if not os.path.isfile(cfg_path) or not os.path.isfile(os.path.join(path, MODEL_FILE)) and \
            not any(n.endswith(".safetensors") for n in os.listdir(path)):
        return False
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):  # not an HF config; a checkpoint of ours names its damaged file on verification
        return False
    return isinstance(cfg, dict) and cfg.get("model_type") in HF_MODEL_TYPES


def no_weights_detail(path: str) -> str:
    """Why a directory given as weights (--init_from, --ref_model, ...) is neither one of our checkpoints nor a
    Hugging Face Llama directory, when its files say more than "nothing there": "" otherwise."""
    try:
        names = set(os.listdir(path))
    except OSError:
        return ""
    if any(n.endswith(".safetensors") for n in names):
        kind = None
        try:
            with open(os.path.join(path, RUN_CONFIG), encoding="utf-8") as f:
                kind = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError):
            pass
        return f" (its config.json says model_type {kind!r}; a Llama model is needed)" if kind else ""
    pickled = sorted(n for n in names if n.endswith((".bin", ".pt", ".pth")) and not n.startswith("optimizer"))
    if pickled and RUN_CONFIG in names:
        return (f" ({pickled[0]} is a pickle, which this project never loads: unpickling runs code. Save the model "
                "as safetensors first: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
                "safe_serialization=True))")
    return ""


def saved_config(out_dir: str) -> Optional[dict]:
    """The configuration a resume of `out_dir` would start from, as far as a look without hashing can
    tell: config.json of the newest checkpoint marked COMPLETE, else the run directory's config.json.
    None when there is none; ValueError when it does not read as a JSON object (the full resume path
    names the file)."""
    done = [p for _, p in listed_checkpoints(out_dir) if os.path.isfile(os.path.join(p, COMPLETE_MARKER))]
    for path in [os.path.join(p, RUN_CONFIG) for p in done[:1]] + [os.path.join(out_dir, RUN_CONFIG)]:
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                raise ValueError(f"{path}: unreadable ({e})") from e
            if not isinstance(data, dict):
                raise ValueError(f"{path}: not a JSON object")
            return data
    return None


def checkpoint_choice_problem(path: str, which: str) -> Optional[str]:
    """The message of checkpoint.select.select_checkpoint(path, which) when it can be told without
    opening a checkpoint that the choice names nothing (those are exit 2: checkpoint.verify.
    selection_exit_code): a malformed `which`; `latest`, `best` or `step_N` of a run (or a path) with
    no such checkpoint; anything but `latest` of one checkpoint directory. None when the full path must decide (it verifies
    what exists: a damaged checkpoint is exit 5 there)."""
    which = (which or "latest").strip()
    if is_checkpoint_dir(path):
        if which != "latest":
            return f"{path} is one checkpoint; --checkpoint={which} needs the run directory"
        return None
    found = listed_checkpoints(path)
    names = ", ".join(os.path.basename(p) for _, p in found) or "none"
    if which == "latest":
        return None if found else f"{path}: no complete checkpoint (found: {names})"
    if which == "best":
        return None if found else (f"{path}: no valid checkpoint has a validation loss or reward (found: {names}); "
                                   "use --checkpoint=latest")
    m = _STEP.match(which) or re.match(r"^(\d+)$", which)
    if not m:
        return f"--checkpoint={which!r}: expected latest, best or step_N"
    step = int(m.group(1))
    if any(s == step for s, _ in found):
        return None
    return f"{path}: no checkpoint at step {step} (found: {names})"
