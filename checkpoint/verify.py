"""Which checkpoints of a run are whole: verification, finding the newest valid one (and the exit code of a choice
that finds none), and pruning to the last K (+ the best by validation loss).

Verification (`verify_checkpoint`) checks that COMPLETE is there, that manifest.json names only files of the
directory, each with its size and sha256, that the JSON sidecars parse with the shape every reader relies on
(utils/checkpoint_json.py), that no symbolic link leaves the directory, and, for a sharded checkpoint, that
DCP's index and every rank's shard are there (checkpoint/dcp_files.py). Every damaged case and what each
command does with it: docs/errors.md, "Damaged checkpoints".

Owns: the verdict on a directory and the cache of directories already hashed. Must never: write or modify a
checkpoint other than removing the ones pruning drops (damaged ones included), or load tensors.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from typing import Callable, Optional

from utils.checkpoint_json import is_int, json_problem, pipeline_meta_problem, read_json, trainer_state_problem
from utils.checkpoint_layout import (COMPLETE_MARKER, DCP_MANIFEST, MANIFEST, PIPELINE_META, SIDECARS, STEP_PREFIX,
                                     TRAINER_STATE, plain_file_name)
from utils.constants import EXIT_BAD_CHECKPOINT, EXIT_BAD_CONFIG
from utils.errors import CheckpointError, DamagedCheckpointError
from utils.run_dir import listed_checkpoints, misnamed_checkpoints


def list_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every finished-looking directory, newest first (not yet verified)."""
    return listed_checkpoints(out_dir)


def selection_score(trainer_state: dict) -> Optional[tuple[float, str]]:
    """What `best` means for a checkpoint, lower is better, and its words: the validation loss, else (a task
    whose validation has no loss: GRPO's held-out greedy rewards) the negated validation reward; None when the
    checkpoint was saved without an evaluation."""
    loss, reward = trainer_state.get("val_loss"), trainer_state.get("val_reward")
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return float(loss), f"val_loss {loss:.4f}"
    if isinstance(reward, (int, float)) and not isinstance(reward, bool):
        return -float(reward), f"val_reward {reward:.4f}"
    return None


def prune_checkpoints(out_dir: str, keep_last: int, keep_best: bool,
                      log: Callable[[str], None] = print) -> None:
    """Keep the `keep_last` newest *valid* checkpoints and the valid best one (`selection_score`).

    Only checkpoints that pass `verify_checkpoint` count: a damaged directory (torn, truncated,
    corrupted) can never be loaded, so it is removed and never takes the place of a good one. The
    newest valid checkpoint is therefore always kept, whatever keep_last says.
    """
    ckpts = list_checkpoints(out_dir)
    valid, damaged = [], []
    for _, p in ckpts:
        problem = verify_checkpoint(p, trust_cache=True)
        (valid if problem is None else damaged).append((p, problem))
    keep = {p for p, _ in valid[:max(1, keep_last)]}
    if keep_best:
        best, best_path = float("inf"), None
        for p, _ in valid:
            try:
                score = selection_score(read_json(os.path.join(p, TRAINER_STATE)))
            except (OSError, ValueError):
                continue
            if score is not None and score[0] < best:
                best, best_path = score[0], p
        if best_path:
            keep.add(best_path)
    for p, problem in damaged:
        log(f"[checkpoint] removing damaged {p}: {problem}")
        shutil.rmtree(p, ignore_errors=True)
    for p, _ in valid:
        if p not in keep:
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------- verification

# Checkpoints this process has verified (or written), by path, with the (name, size, mtime_ns) of
# their files at that moment: pruning verifies every checkpoint at every save, and re-hashing
# gigabytes of unchanged files each time would cost more than the save itself.
_verified: dict[str, tuple] = {}


def _signature(path: str) -> Optional[tuple]:
    try:
        return tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path)))
    except OSError:
        return None


def remember_verified(final: str) -> None:
    """The manifest's hashes were computed from exactly these files: pruning need not hash them again."""
    sig = _signature(final)
    if sig is not None:
        _verified[final] = sig


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest_problem(path: str, check_hashes: bool) -> Optional[str]:
    """None when manifest.json is a JSON object {file: {"bytes": int, "sha256": str}} naming only files
    of this directory, each present with that size (and hash), else the reason."""
    manifest, problem = json_problem(os.path.join(path, MANIFEST))
    if problem:
        return problem
    if not isinstance(manifest, dict):
        return (f"{MANIFEST} holds a {type(manifest).__name__}, not a JSON object of "
                "file -> {bytes, sha256}")
    if not manifest:
        return f"{MANIFEST} lists no file"
    for name, info in manifest.items():
        if not plain_file_name(name):
            return f"{MANIFEST} names {name!r}, which is not a file of the checkpoint directory"
        if not isinstance(info, dict) or not is_int(info.get("bytes")) or not isinstance(info.get("sha256"), str):
            return f"{MANIFEST}: the entry of {name} is not {{\"bytes\": int, \"sha256\": str}}"
    for name, info in manifest.items():
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            return f"missing file {name}"
        size = os.path.getsize(fp)
        if size != info["bytes"]:
            return f"{name} has {size} bytes, manifest says {info['bytes']} (truncated?)"
        if check_hashes and sha256_file(fp) != info["sha256"]:
            return f"{name} does not match its sha256 (corrupted)"
def _sidecar_problem(path: str) -> Optional[str]:
    if os.path.lexists(os.path.join(path, PIPELINE_META)):  # a pipeline checkpoint's layout
        data, problem = json_problem(os.path.join(path, PIPELINE_META))
        problem = problem or pipeline_meta_problem(data)
        if problem:
            return problem
    for name in SIDECARS:
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            continue
        data, problem = json_problem(fp)
        if problem:
            return problem
        if name == TRAINER_STATE:
            problem = trainer_state_problem(data)
            if problem:
                return problem
        elif not isinstance(data, dict):
            return f"{name} holds a {type(data).__name__}, not a JSON object"
    return None


def _link_problem(path: str) -> Optional[str]:
    """A checkpoint is its own directory's files: a symbolic link that leaves it (a model.safetensors, or the
    whole step_N, linked to another run's files) is refused, never followed without a word."""
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    if os.path.islink(path) and os.path.dirname(os.path.realpath(path)) != parent:
        return f"{os.path.basename(path)} is a symbolic link to {os.path.realpath(path)}, outside {parent}: refused"
    real = os.path.realpath(path)
    try:
        entries = list(os.scandir(path))
    except OSError:
        return None  # named by the checks that follow
    for e in entries:
        if e.is_symlink():
            target = os.path.realpath(e.path)
            if os.path.dirname(target) != real:
                return f"{e.name} is a symbolic link to {target}, outside the checkpoint directory: refused"
    return None


def verify_checkpoint(path: str, check_hashes: bool = True, trust_cache: bool = False) -> Optional[str]:
    """None when the directory is complete, matches its manifest and its JSON files have the shape
    every reader relies on (and, for a sharded checkpoint, DCP's index and every rank's shard are
    there, confined to the directory), else the reason, naming the file.

    trust_cache: accept a directory this process already hashed (or wrote) whose files still have
    the same names, sizes and mtimes, without hashing it again (pruning does; loading never does).
    """
    sig = _signature(path)
    if trust_cache and sig is not None and _verified.get(path) == sig:
        return None
    _verified.pop(path, None)
    problem = _link_problem(path)
    if problem is not None:
        return problem
    if not os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        return "no COMPLETE marker (save was interrupted)"
    problem = _manifest_problem(path, check_hashes) or _sidecar_problem(path)
    if problem is not None:
        return problem
    if os.path.isfile(os.path.join(path, DCP_MANIFEST)):  # sharded (DCP): DCP's index and every rank's shard
        from checkpoint.dcp_files import dcp_dir_problem  # here: torch.distributed.checkpoint takes ~2 s to import, which
        # commands that never meet a sharded checkpoint (sample.py, eval_lm.py) should not pay
        problem = dcp_dir_problem(path)
        if problem is not None:
            return problem
    if check_hashes and sig is not None and sig == _signature(path):
        _verified[path] = sig
    return None


def find_latest_valid(out_dir: str, log: Callable[[str], None] = print,
                      check_hashes: bool = True) -> Optional[str]:
    """Newest complete, undamaged checkpoint; damaged ones are reported and skipped, and so are directories
    whose name disagrees with the step their trainer_state.json records (utils/run_dir.misnamed_checkpoints)."""
    for path, recorded in misnamed_checkpoints(out_dir):
        log(f"[checkpoint] ignoring {path}: its trainer_state.json records step {recorded}, not the step its name "
            f"says (a copy under another name?); it is neither loaded nor pruned")
    for step, path in list_checkpoints(out_dir):
        problem = verify_checkpoint(path, check_hashes=check_hashes)
        if problem is None:
            return path
        log(f"[checkpoint] skipping {path}: {problem}")
    return None


def resolve_checkpoint_dir(path: str, log: Callable[[str], None] = print) -> Optional[str]:
    """Accept a checkpoint directory itself or a run directory holding checkpoints/.
    A checkpoint directory that fails verification raises DamagedCheckpointError (exit 5)."""
    if os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
        problem = verify_checkpoint(path)
        if problem:
            raise DamagedCheckpointError(f"checkpoint {path} is not usable: {problem}")
        return path
    return find_latest_valid(path, log=log)


def selection_exit_code(e: CheckpointError, path: str, which: str = "latest") -> int:
    """Exit code of a failed choice of checkpoint (`--ckpt=path --checkpoint=which`): 5 when what was
    asked for exists but is damaged (a checkpoint directory failing verification; step_N, latest or
    best when every checkpoint there fails it), 2 when it names nothing (no such step, no run)."""
    if isinstance(e, DamagedCheckpointError):
        return EXIT_BAD_CHECKPOINT
    which = (which or "latest").strip()
    found = list_checkpoints(path) if os.path.isdir(path) else []
    digits = which[len(STEP_PREFIX):] if which.startswith(STEP_PREFIX) else which.removeprefix("step")
    if digits.isdigit():
        found = [(s, p) for s, p in found if s == int(digits)]
    elif which not in ("latest", "best"):
        return EXIT_BAD_CONFIG
    damaged = bool(found) and all(verify_checkpoint(p) is not None for _, p in found)
    return EXIT_BAD_CHECKPOINT if damaged else EXIT_BAD_CONFIG

