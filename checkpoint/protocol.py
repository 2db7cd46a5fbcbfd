"""The atomic save protocol every checkpoint format shares: where step N is written first (step_N.tmp) and
published (step_N), the free-space check before a save, the guard that turns a write that does not fit into
DiskFullError (exit 7) with the partial directory removed, and the publish itself (manifest of sizes and
sha256, COMPLETE, fsync, atomic rename; utils/publish.py's convention).

Protocol: all ranks write into `step_N.tmp/`; barrier; rank 0 writes the manifest and COMPLETE, fsyncs, then
`os.replace`s the directory into place (a re-saved step swaps the old directory aside to `step_N.old` first).
A crash at any instant leaves either the previous checkpoints untouched or a `.tmp` directory that loading
ignores. In the synchronous saves each barrier of a save is a verdict of every rank (`agreed_phase`): a write
that does not fit at one rank ends every rank alike.

Owns: the protocol. Must never: choose what a format's files hold, or mark a checkpoint complete before every
rank wrote.
"""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Tuple

from checkpoint.verify import sha256_file
from utils.checkpoint_json import write_json
from utils.checkpoint_layout import COMPLETE_MARKER, MANIFEST, parse_step, step_dir_name
from utils.constants import EXIT_DISK_FULL
from utils.disk_space import DiskFullError, free_bytes, human, is_disk_full, tree_bytes
from utils.errors import one_line
from utils.publish import make_temp_dir, publish_dir, temp_dir_for


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
    """What `save_guard` yields: the step's directories, and the file being written (the writer sets `file`
    before each write, for the message)."""
    file: Optional[str] = None

    def __init__(self, ckpt_root: str = "", step: int = 0) -> None:
        self.root, self.step = ckpt_root, step
        self.final, self.tmp = step_dir_paths(ckpt_root, step)

    def did_not_fit(self, e: BaseException) -> str:
        """The one line of a write of this save that did not fit (`is_disk_full(e)`)."""
        if isinstance(e, DiskFullError):  # already one line (the free-space check, a write translated earlier)
            return str(e)
        return (f"saving checkpoint {self.final} failed: writing {self.file or self.tmp} did not fit (disk full or a "
                f"file-size limit: {one_line(e)[:160]}); {human(free_bytes(self.root))} free on {self.root}; the "
                f"partial {os.path.basename(self.tmp)} was removed and the earlier checkpoints are intact")


def step_dir_paths(ckpt_root: str, step: int) -> tuple[str, str]:
    """(final, tmp) of step `step`'s checkpoint under `ckpt_root`: where it is published, and the temporary
    directory its files are written into first (utils/publish.py's convention)."""
    final = os.path.join(ckpt_root, step_dir_name(step))
    return final, temp_dir_for(final)


@contextlib.contextmanager
def save_guard(ckpt_root: str, step: int) -> Iterator[SaveGuard]:
    """Wrap one rank's part of a checkpoint save: a write that does not fit (disk or quota full, RLIMIT_FSIZE;
    `is_disk_full`) removes the partial step_N.tmp, which can then never be published, and becomes one
    DiskFullError naming the file and the free space (exit 7); the published checkpoints are untouched. (The
    free-space check before a save is `prepare_step_dir`'s.)"""
    guard = SaveGuard(ckpt_root, step)
    try:
        yield guard
    except DiskFullError:
        shutil.rmtree(guard.tmp, ignore_errors=True)
        raise
    except Exception as e:  # noqa: BLE001 - only a disk-full write is translated; anything else re-raises
        if not is_disk_full(e):
            raise
        shutil.rmtree(guard.tmp, ignore_errors=True)
        raise DiskFullError(guard.did_not_fit(e)) from e


Verdict = Optional[Tuple[int, str]]  # None (this rank is fine) or (exit code, one line)


def every_rank(verdict: Verdict, group=None) -> Verdict:
    """The collective of `agreed_phase` over `group` (None: the world): utils/dist.first_error_of_ranks. One
    process (or no process group) gets its own verdict back."""
    from utils.dist import first_error_of_ranks
    return first_error_of_ranks(verdict, group=group)


def this_rank_only(verdict: Verdict) -> Verdict:
    """A save by one process alone (no collective)."""
    return verdict


def agreement(collective: bool, group=None) -> Callable[[Verdict], Verdict]:
    """How the phases of a save agree: `every_rank` over `group` (None: the world) for a collective save,
    `this_rank_only` for a save by one process."""
    if not collective:
        return this_rank_only
    return every_rank if group is None else functools.partial(every_rank, group=group)


@contextlib.contextmanager
def agreed_phase(guard: SaveGuard, agree: Callable[[Verdict], Verdict] = every_rank) -> Iterator[None]:
    """One phase of a collective save (rank 0 checking the space and making step_N.tmp; every rank writing its
    files; rank 0 publishing) ended by ONE verdict of every rank in place of a barrier (`agree`: `every_rank`,
    or `this_rank_only` for a save by one process). A write that does not fit at ANY rank ends EVERY rank with
    a DiskFullError (exit 7): the failing rank's own line, the others the failing rank's line, and the partial
    step_N.tmp removed (save_guard). Any other error is raised as itself at its rank and as "failed at another
    rank" at the others. Without the verdict, the failing rank exited 7 and the others waited in the barrier
    until its death broke the connection (a gloo traceback, exit 1)."""
    err: Optional[Exception] = None
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every rank hears of it, then it is raised again below
        err = e
    mine: Verdict = None
    if err is not None:
        mine = (EXIT_DISK_FULL, guard.did_not_fit(err)) if is_disk_full(err) else \
            (1, f"{type(err).__name__}: {one_line(err)[:300]}")
    verdict = agree(mine)
    if err is not None:
        if is_disk_full(err) and not isinstance(err, DiskFullError):
            raise DiskFullError(mine[1]) from err
        raise err
    if verdict is None:
        return
    if verdict[0] == EXIT_DISK_FULL:
        raise DiskFullError(verdict[1])
    raise RuntimeError(f"saving checkpoint {guard.final} failed at another rank: {verdict[1]}")


def prepare_step_dir(guard: SaveGuard, rank: int, agree: Callable[[Verdict], Verdict] = every_rank) -> None:
    """The first phase of every save: rank 0 checks the free space (`check_space_for_save`) and makes a fresh
    step_N.tmp (one left by a crash was never complete: dropped), then every rank's verdict (`agreed_phase`):
    step_N.tmp exists for every rank's writes, or every rank ends alike."""
    with agreed_phase(guard, agree):
        if rank == 0:
            check_space_for_save(guard.root, guard.step)
            make_temp_dir(guard.final)


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
