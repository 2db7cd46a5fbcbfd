"""The atomic save protocol every checkpoint format shares: where step N is written first (step_N.tmp) and
published (step_N), the free-space check before a save, the guard that turns a write that does not fit into
DiskFullError (exit 7) with the partial directory removed, and the publish itself (manifest of sizes and
sha256, COMPLETE, fsync, atomic rename; utils/publish.py's convention).

Protocol: all ranks write into `step_N.tmp/`; barrier; rank 0 writes the manifest and COMPLETE, fsyncs, then
`os.replace`s the directory into place (a re-saved step swaps the old directory aside to `step_N.old` first).
A crash at any instant leaves either the previous checkpoints untouched or a `.tmp` directory that loading
ignores.

Owns: the protocol. Must never: choose what a format's files hold, or mark a checkpoint complete before every
rank wrote.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from checkpoint.verify import sha256_file
from utils.checkpoint_json import write_json
from utils.checkpoint_layout import COMPLETE_MARKER, MANIFEST, parse_step, step_dir_name
from utils.disk_space import DiskFullError, free_bytes, human, is_disk_full, tree_bytes
from utils.errors import one_line
from utils.publish import publish_dir, temp_dir_for


def newest_complete(ckpt_root: str) -> Optional[str]:
    """The newest step_N directory under `ckpt_root` holding COMPLETE (unverified), or None."""
    try:
        names = os.listdir(ckpt_root)
    except OSError:
        return None
    steps = sorted((step, n) for n in names if (step := parse_step(n)) is not None)
    for _, name in reversed(steps):
        if os.path.isfile(os.path.join(ckpt_root, name, COMPLETE_MARKER)):
            return os.path.join(ckpt_root, name)
    return None


def check_space_for_save(ckpt_root: str, step: int) -> None:
    """Before a save writes anything: refuse (DiskFullError) when the filesystem holding `ckpt_root` has
    less free space than the newest complete checkpoint there takes, since the new one is about as large
    and is written beside the old ones (pruning follows the publish). No checkpoint yet: nothing to
    compare, the save goes ahead (a write that does not fit is still caught by `save_guard`)."""
    last = newest_complete(ckpt_root)
    if last is None:
        return
    need, free = tree_bytes(last), free_bytes(ckpt_root)
    if free is not None and free < need:
        raise DiskFullError(
            f"not enough free space to save checkpoint {os.path.join(ckpt_root, step_dir_name(step))}: "
            f"{human(free)} free on {ckpt_root}, the last checkpoint ({os.path.basename(last)}) takes "
            f"{human(need)}; nothing was written and the checkpoints there are intact (free space or move "
            "--out_dir, then resume)")


def _no_barrier() -> None:
    """One process: nothing to wait for."""


@dataclass
class SaveJob:
    """One save, as every format writes it: where and which step, this rank's place, what the JSON sidecars and this
    rank's extra file hold, how many checkpoints to keep, and the collective and hooks around it."""
    out_dir: str
    step: int
    trainer_state: dict               # rank 0's view; recorded with the step and the world size
    model_config: dict
    run_config: dict
    extra_state: dict = field(default_factory=dict)  # this rank's RNG (+ rank state): extra_rank{r}.pt
    rank: int = 0
    world_size: int = 1
    keep_last: int = 3
    barrier: Callable[[], None] = _no_barrier        # every rank of the save
    fault_hook: Optional[Callable[[], None]] = None  # tests: called on rank 0 mid-save (a kill there)
    log: Callable[[str], None] = print


class SaveGuard:
    """What `save_guard` yields: the writer sets `file` before each write, for the message."""
    file: Optional[str] = None


def step_dir_paths(ckpt_root: str, step: int) -> tuple[str, str]:
    """(final, tmp) of step `step`'s checkpoint under `ckpt_root`: where it is published, and the temporary
    directory its files are written into first (utils/publish.py's convention)."""
    final = os.path.join(ckpt_root, step_dir_name(step))
    return final, temp_dir_for(final)


@contextlib.contextmanager
def save_guard(ckpt_root: str, step: int, check_space: bool = True) -> Iterator[SaveGuard]:
    """Wrap one rank's part of a checkpoint save. Before: `check_space_for_save` (check_space=True, the
    rank that creates step_N.tmp). During: a write that does not fit (disk or quota full, RLIMIT_FSIZE;
    `is_disk_full`) removes the partial step_N.tmp, which can then never be published, and becomes one
    DiskFullError naming the file and the free space (exit 7); the published checkpoints are untouched."""
    final, tmp = step_dir_paths(ckpt_root, step)
    if check_space:
        check_space_for_save(ckpt_root, step)
    guard = SaveGuard()
    try:
        yield guard
    except DiskFullError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # noqa: BLE001 - only a disk-full write is translated; anything else re-raises
        if not is_disk_full(e):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        free = free_bytes(ckpt_root)
        raise DiskFullError(
            f"saving checkpoint {final} failed: writing {guard.file or tmp} did not fit (disk full or a file-size "
            f"limit: {one_line(e)[:160]}); {human(free)} free on {ckpt_root}; the partial {os.path.basename(tmp)} "
            "was removed and the earlier checkpoints are intact") from e


def publish_checkpoint_dir(tmp: str, final: str, step: int) -> None:
    """Rank 0, after every rank wrote into `tmp`: manifest (size + sha256 of every file), COMPLETE,
    fsync, then an atomic rename to `final` (an older directory of the same step is moved aside first).
    Shared by every format (checkpoint/plain.py, dcp.py, pipeline.py)."""
    manifest = {name: {"bytes": os.path.getsize(os.path.join(tmp, name)),
                       "sha256": sha256_file(os.path.join(tmp, name))}
                for name in sorted(os.listdir(tmp))}
    write_json(os.path.join(tmp, MANIFEST), manifest)
    write_json(os.path.join(tmp, COMPLETE_MARKER), {"step": int(step)})
    # fsync, rename; re-saving a step (e.g. after resume) swaps the old directory aside first
    publish_dir(tmp, final, replace=True)
