"""Disk space for writers: the error a full disk (or a file-size limit) ends a save with, and the
free-space arithmetic a writer checks before it starts.

Owns: `DiskFullError` (exit 7, EXIT_DISK_FULL: not retried by monitor_process.py, since a restart would
fill the same disk again), `is_disk_full(e)`: whether an exception from a writer means the bytes did not
fit (OSError ENOSPC / EFBIG / EDQUOT, also wrapped: torch's stream writer reports a short write as
"unexpected pos", safetensors as "I/O error: ... (os error 28)", DCP as a CheckpointException that
embeds the OSError), `writing(path)`, the guard around a write of any other file of a run directory or log
(metrics.jsonl, the heartbeat, config.json, monitor.log, ...) that turns such a write into one DiskFullError
naming the file, `free_bytes(path)`, `tree_bytes(path)` and `human(n)`.
Must never: import anything but the standard library (the torch-free supervisor and pre-checks import
it), delete anything, or decide what a caller does with a refused write.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
from typing import Iterator, Optional

from utils.constants import EXIT_DISK_FULL

_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)})
# What the writers that do not raise OSError say about a write the disk (or RLIMIT_FSIZE) cut short.
_MARKERS = ("no space left on device", "file too large", "disk quota exceeded", "os error 28)",
            "os error 27)", "os error 122)", "unexpected pos", "file write failed", "storagefull", "filetoolarge")


class DiskFullError(OSError):
    """A write that did not fit: the disk (or quota) is full, or a file-size limit (RLIMIT_FSIZE) was hit.
    The message names the path and the free space, on one line."""
    exit_code, exit_prefix = EXIT_DISK_FULL, "disk full: "  # utils.errors.exit_code_for


def is_disk_full(e: BaseException) -> bool:
    """Whether `e` (or an exception it was raised from) is a write that ran out of space or hit a
    file-size limit. A DiskFullError already is."""
    seen: set[int] = set()
    cur: Optional[BaseException] = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, DiskFullError):
            return True
        if isinstance(cur, OSError) and cur.errno in _ERRNOS:
            return True
        text = str(cur).lower()
        if any(m in text for m in _MARKERS):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def disk_full_error(path: str, e: BaseException) -> DiskFullError:
    """The DiskFullError of a write of `path` that did not fit (`e`, for which is_disk_full holds): one line
    naming the file and the free space on its filesystem."""
    why = " ".join(str(e).split())[:160] or type(e).__name__
    where = os.path.dirname(os.path.abspath(path))
    return DiskFullError(f"writing {path} did not fit (disk or quota full, or a file-size limit: {why}); "
                         f"{human(free_bytes(where))} free on {where}")


@contextlib.contextmanager
def writing(path: str) -> Iterator[None]:
    """Around a write of `path`: a write that does not fit (`is_disk_full`) becomes `disk_full_error(path, e)`
    (exit 7, never retried: a restart would find the same full disk); any other error passes unchanged."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:  # noqa: BLE001 - only a disk-full write is translated; anything else re-raises
        if not is_disk_full(e):
            raise
        raise disk_full_error(path, e) from e


def free_bytes(path: str) -> Optional[int]:
    """Bytes free to this user on the filesystem holding `path` (its nearest existing parent), or None
    when that cannot be told."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def tree_bytes(path: str) -> int:
    """Bytes of the regular files under `path` (links not followed); 0 for what cannot be read."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(dirpath, name)):
                total += st.st_size
    return total


def human(n: Optional[int]) -> str:
    """1536 -> '1.5 KiB'; None -> 'unknown'."""
    if n is None:
        return "unknown"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v)} B" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{n} B"
