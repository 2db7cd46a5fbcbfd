"""Which checkpoint a command means, and the configuration a resume starts from: `select_checkpoint` (`latest`,
`best` by validation loss or reward, `step_N`; sample.py, export_hf.py, --init_from), `saved_run_config` (the newest valid
checkpoint's config.json, else the run directory's) and `resolve_resume_config` (that configuration with the
command line over it, utils/run_config.py's checks applied).

Owns: the choice. Must never: exec a saved file, or load tensors.
"""
from __future__ import annotations

import os
import re
from typing import Callable, Optional, Sequence, TypeVar

from checkpoint.verify import (find_latest_valid, list_checkpoints, resolve_checkpoint_dir, selection_score,
                               verify_checkpoint)
from utils.checkpoint_json import read_json
from utils.checkpoint_layout import COMPLETE_MARKER, MANIFEST, RUN_CONFIG, TRAINER_STATE
from utils.configurator import ConfigError, parse_config
from utils.errors import CheckpointError, DamagedCheckpointError
from utils.run_config import NOT_RESTORED, changed_values, config_from_saved, resume_problems

T = TypeVar("T")


def saved_run_config(run_dir: str) -> tuple[Optional[dict], Optional[str]]:
    """(the configuration dict a resume should start from, the file it came from).

    The newest valid checkpoint's config.json first (it matches the weights being resumed), else
    the run directory's config.json (a run that stopped before its first checkpoint)."""
    found = find_latest_valid(run_dir, log=lambda s: None) if os.path.isdir(run_dir) else None
    for path in ([os.path.join(found, RUN_CONFIG)] if found else []) + [os.path.join(run_dir, RUN_CONFIG)]:
        if os.path.isfile(path):
            try:
                data = read_json(path)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{path}: unreadable saved configuration ({e})") from e
            if not isinstance(data, dict):
                raise ConfigError(f"{path}: saved configuration is not a JSON object")
            return data, path
    return None, None


def resolve_resume_config(defaults: T, argv: Sequence[str], run_dir: str,
                          log: Callable[[str], None] = print,
                          allow_field: str = "allow_data_change") -> tuple[T, Optional[str]]:
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


_STEP = re.compile(r"^step_?(\d+)$")


def select_checkpoint(path: str, which: str = "latest", log: Callable[[str], None] = print) -> str:
    """A verified checkpoint directory of a run: `latest` (newest valid), `best` (lowest validation
    loss among valid ones) or `step_N` / `N`. `path` may also be a checkpoint directory itself
    (then `which` must be `latest`). Raises CheckpointError with what exists when none matches."""
    which = (which or "latest").strip()
    if os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        if which != "latest":
            raise CheckpointError(f"{path} is one checkpoint; --checkpoint={which} needs the run directory")
        found = resolve_checkpoint_dir(path, log=log)
        assert found is not None
        return found
    all_ckpts = list_checkpoints(path)
    names = ", ".join(os.path.basename(p) for _, p in all_ckpts) or "none"
    if which == "latest":
        found = find_latest_valid(path, log=log)
        if found is None:
            raise CheckpointError(f"{path}: no complete checkpoint (found: {names})")
        return found
    if which == "best":
        best, best_path, words = float("inf"), None, ""
        for _, p in all_ckpts:
            if verify_checkpoint(p) is not None:
                continue
            score = selection_score(read_json(os.path.join(p, TRAINER_STATE)))
            if score is not None and score[0] < best:
                (best, words), best_path = score, p
        if best_path is None:
            raise CheckpointError(f"{path}: no valid checkpoint has a validation loss or reward (found: {names}); "
                                  "use --checkpoint=latest")
        log(f"[checkpoint] best: {best_path} ({words})")
        return best_path
    m = _STEP.match(which) or (re.match(r"^(\d+)$", which))
    if not m:
        raise CheckpointError(f"--checkpoint={which!r}: expected latest, best or step_N")
    step = int(m.group(1))
    for s, p in all_ckpts:
        if s == step:
            problem = verify_checkpoint(p)
            if problem:
                raise DamagedCheckpointError(f"checkpoint {p} is not usable: {problem}")
            return p
    raise CheckpointError(f"{path}: no checkpoint at step {step} (found: {names})")
