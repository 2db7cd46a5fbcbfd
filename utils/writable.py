"""Whether a command can write where it is told to, asked before it does any expensive work.

Owns: `check_writable_dir(path, flag)`, the one up-front check of an output directory that every writing
command makes (the tokenizer trainers, the pretokenizers, the index builder, export_hf.py, the trainer's
checkpoints directory: utils/run_lock.check_run_dir_layout): `path` is a directory this process can create
entries in, or one it can create (its nearest existing ancestor is such a directory); else
`UnwritableDirError` (exit 2, one line naming the path and why: a regular file in the way, a read-only
directory or filesystem, a permission). The answer is the filesystem's, not the permission bits': an empty
directory is created in the place and removed again (root ignores the bits; a read-only mount does not).
A probe that does not fit is a full disk (DiskFullError, exit 7: utils/disk_space.py).
Must never: import anything but the standard library and utils/ (the torch-free pre-checks use it), create
`path` itself, or leave anything behind.
"""
from __future__ import annotations

import os
import stat
import tempfile
from typing import Optional

from utils.constants import EXIT_BAD_CONFIG
from utils.disk_space import disk_full_error, is_disk_full

PROBE_PREFIX = ".write-probe-"


class UnwritableDirError(Exception):
    """An output directory that cannot be created or written: a flag error (exit 2, never retried), one line."""
    exit_code = EXIT_BAD_CONFIG
    exit_prefix = "bad configuration: "  # utils.errors.exit_code_for


def _probe(directory: str) -> None:
    """Create and remove an empty directory in `directory`: OSError when no entry can be made there."""
    os.rmdir(tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=directory))


def _nearest_existing(path: str) -> str:
    while not os.path.lexists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _kind(path: str) -> str:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return "a broken symbolic link"
    return "a file" if stat.S_ISREG(mode) else "not a directory"


def _problem(directory: str) -> Optional[str]:
    """Why no entry can be made in `directory` (creating it and its parents first if need be), or None."""
    existing = _nearest_existing(directory)
    if not os.path.isdir(existing):
        if existing == directory:
            return f"{directory} is {_kind(existing)}, not a directory"
        return f"cannot create {directory}: {existing} is {_kind(existing)}, not a directory"
    try:
        _probe(existing)
    except OSError as e:
        if is_disk_full(e):
            raise disk_full_error(os.path.join(existing, PROBE_PREFIX + "*"), e) from e
        where = "" if existing == directory else f" (to create {directory})"
        return f"cannot write in {existing}{where}: {e.strerror or e}"
    return None


def check_writable_dir(path: str, flag: str = "--out_dir", *, staged: bool = False) -> None:
    """UnwritableDirError `<flag>=<path>: <why>` (`<path>: <why>` with flag="") unless the command can write `path`.
    staged: the command publishes `path` by renaming a sibling `<path>.tmp/` into place (utils/publish.py
    staged_dir), so the directory holding `path` must take new entries too."""
    target = os.path.abspath(path)
    places = [target] + ([os.path.dirname(target)] if staged and os.path.dirname(target) != target else [])
    for place in places:
        problem = _problem(place)
        if problem:
            raise UnwritableDirError(f"{flag}={path}: {problem}" if flag else f"{path}: {problem}")
