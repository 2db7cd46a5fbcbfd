"""One run per run directory: an OS lock on `<out_dir>/run.lock`, held for the life of the run.

Owns: the lock that keeps a second trainer (or a second supervisor) out of an `--out_dir` a run is
using, and the line that refuses it (exit 6, utils/constants.EXIT_RUN_DIR_BUSY). Two trainers on one
directory otherwise "resume" each other's run_start.json, interleave metrics rows and overwrite each
other's checkpoints.

How it holds:
- `flock(LOCK_EX | LOCK_NB)` on the run directory itself (on `run.lock` where the filesystem cannot lock a
  directory), kept open until the process ends or `release()`. The kernel drops the lock when the last
  descriptor of it closes, SIGKILL included, so a crashed run never leaves a stale lock. Deleting `run.lock`
  does not unlock the directory; the file only says who took the lock last and is never the evidence of a
  holder.
- The holder writes `{"pid", "host", "since", "token", "command"}` into the file; the refusal names them.
- Who counts as the same run: the supervisor (monitor_process.py) takes the lock and passes its random
  token to every attempt in the environment (`LLM_RUN_LOCK_TOKEN`); a trainer that finds the lock
  held by the holder of that token continues under it (the supervisor's restarts). Under torchrun only
  global rank 0 takes the lock: the other ranks are the same run by construction (torchrun ends them
  when rank 0 exits).
- Whoever writes the directory holds the lock: the supervisor hands its locked descriptor to each attempt
  (`Popen(pass_fds=...)`), so an attempt that outlives a killed supervisor still holds the directory and no
  second run gets in while it writes. And it does not outlive it unnoticed: the supervisor names itself in
  `LLM_RUN_SUPERVISOR` (pid and start time); `SupervisorWatch` tells the trainer when that process is gone,
  and the trainer then stops as on SIGTERM (finishes the step, saves, exits 75), releasing the lock.
- Filesystems: flock is local to a host on most network filesystems unless they forward it (NFSv4 and
  Lustre with `flock` mounts do); two hosts writing one directory over a filesystem that does not
  forward locks are not detected.

Must never: import torch or anything above utils/ (the supervisor and the trainer's pre-check use it),
delete or rewrite any file but run.lock, or wait for a lock (a busy directory is refused at once).
"""
from __future__ import annotations

import errno
import json
import os
import secrets
import socket
import stat
import sys
import time
from typing import Any, Optional

from utils.checkpoint_layout import CKPT_SUBDIR, RUN_CONFIG, RUN_START
from utils.constants import EXIT_BAD_CONFIG, EXIT_RUN_DIR_BUSY
from utils.disk_space import DiskFullError, disk_full_error, is_disk_full
from utils.writable import UnwritableDirError, check_writable_dir

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no flock; the run goes unlocked and says so
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = "run.lock"
TOKEN_ENV = "LLM_RUN_LOCK_TOKEN"   # the supervisor's token, inherited by its attempts (and torchrun's ranks)
SUPERVISOR_ENV = "LLM_RUN_SUPERVISOR"  # "<pid>:<start time>" of the supervisor whose attempt this is


class RunDirBusy(Exception):
    """`--out_dir` is held by another live run: refused with one line (exit 6, never retried)."""
    exit_code = EXIT_RUN_DIR_BUSY
    exit_prefix = ""


class RunDirUnusable(Exception):
    """`--out_dir` cannot be created or written (a file, a read-only filesystem, /proc): a flag error."""
    exit_code = EXIT_BAD_CONFIG
    exit_prefix = "bad configuration: "


# what acquire() and check_run_dir_layout() refuse a run directory with, each with its exit code (6, 2, 7)
REFUSALS = (RunDirBusy, RunDirUnusable, DiskFullError)


class RunLock:
    """The held lock of one run directory; `release()` (or the process ending) drops it."""

    def __init__(self, path: str, fd: Optional[int], token: str, inherited: bool = False) -> None:
        self.path, self.fd, self.token, self.inherited = path, fd, token, inherited

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)  # closing the only descriptor drops the flock
            finally:
                self.fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_path(out_dir: str) -> str:
    return os.path.join(out_dir, LOCK_NAME)


def _read_holder(path: str) -> dict:
    """What the holder wrote (it writes right after it locks: read twice before giving up)."""
    for attempt in range(3):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                data = json.loads(f.read() or "null")
            if isinstance(data, dict):
                return data
        except (OSError, ValueError):
            pass
        time.sleep(0.05 * (attempt + 1))
    return {}


def _describe(holder: dict) -> str:
    pid, host = holder.get("pid", "?"), holder.get("host", "?")
    since = holder.get("since")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else ""
    what = holder.get("command")
    return f"pid {pid} on {host}{when}" + (f" ({what})" if what else "")


def make_run_dir(out_dir: str, flag: str = "--out_dir") -> None:
    """Create `out_dir` (and parents), or refuse it as a flag error naming why."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise RunDirUnusable(f"{flag}={out_dir}: exists and is not a directory")
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise RunDirUnusable(f"{flag}={out_dir}: cannot create the run directory ({e.strerror or e})") from e


def _lock_directory(out_dir: str, path: str, flag: str) -> int:
    """An open descriptor to lock: the directory itself (deleting run.lock cannot unlock it), or run.lock on a
    filesystem that refuses to lock a directory (NFS emulates flock with write locks on regular files)."""
    try:
        fd = os.open(out_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise RunDirUnusable(f"{flag}={out_dir}: cannot open the run directory ({e.strerror or e})") from e
    if fcntl is None:  # pragma: no cover
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # probe: may this filesystem lock a directory?
        fcntl.flock(fd, fcntl.LOCK_UN)
        return fd
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return fd  # it can: someone holds it
        os.close(fd)
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        if is_disk_full(e):  # a full disk (no inode left) is exit 7, as every other write of the run directory
            raise disk_full_error(path, e) from e
        raise RunDirUnusable(f"{flag}={out_dir}: cannot write {LOCK_NAME} there ({e.strerror or e})") from e


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError, OverflowError) as e:
        return isinstance(e, PermissionError)  # someone else's live process
    return True


def acquire(out_dir: str, *, command: str = "", flag: str = "--out_dir") -> RunLock:
    """Lock `out_dir` for this run, or raise RunDirBusy naming the holder (RunDirUnusable when the
    directory cannot be created or the lock file written; DiskFullError, exit 7, when it did not fit). A lock held by the supervisor whose token
    this process inherited counts as ours: the RunLock returned then holds nothing (`inherited`)."""
    make_run_dir(out_dir, flag)
    path = lock_path(out_dir)
    if os.path.islink(path) or (os.path.exists(path) and not os.path.isfile(path)):
        raise RunDirUnusable(f"{flag}={out_dir}: {LOCK_NAME} is not a regular file; remove it")
    fd = _lock_directory(out_dir, path, flag)
    if fcntl is None:  # pragma: no cover
        return RunLock(path, fd, token="")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise RunDirUnusable(f"{flag}={out_dir}: cannot lock {LOCK_NAME} ({e.strerror or e})") from e
        holder = _read_holder(path)
        mine = os.environ.get(TOKEN_ENV)
        if mine and holder.get("token") == mine:
            return RunLock(path, None, token=mine, inherited=True)
        orphan = ""
        if holder.get("host") == socket.gethostname() and "pid" in holder and not _pid_alive(holder["pid"]):
            orphan = (f" (pid {holder['pid']} has exited; a process it started, such as its trainer, still holds "
                      "the directory)")
        raise RunDirBusy(f"{flag}={out_dir} is in use by another run: {_describe(holder)} holds {path}{orphan}; "
                         "wait for it to end or stop it, or use another --out_dir") from None
    token = secrets.token_hex(16)
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "token": token,
              "command": command[:300]}
    text = json.dumps(record) + "\n"
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        if stat.S_ISDIR(os.fstat(fd).st_mode):  # the directory is locked: run.lock is replaced whole
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        else:  # run.lock itself is the locked file: written in place (a new inode would be unlocked)
            os.ftruncate(fd, 0)
            os.pwrite(fd, text.encode(), 0)
            os.fsync(fd)
    except OSError as e:
        os.close(fd)
        if os.path.exists(tmp):
            os.remove(tmp)
        if is_disk_full(e):
            raise disk_full_error(path, e) from e
        raise RunDirUnusable(f"{flag}={out_dir}: cannot write {LOCK_NAME} there ({e.strerror or e})") from e
    return RunLock(path, fd, token=token)


def _start_time(pid: int) -> Optional[str]:
    """When process `pid` started, as the kernel counts it (/proc/<pid>/stat field 22), or None where /proc has
    no such process or does not exist. With the pid it names one process, never a later one reusing the pid."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # fields after "(comm)": state is field 3, starttime field 22


def supervisor_env(pid: Optional[int] = None) -> dict[str, str]:
    """The environment entry with which a supervisor names itself to its attempts."""
    pid = os.getpid() if pid is None else pid
    return {SUPERVISOR_ENV: f"{pid}:{_start_time(pid) or ''}"}


class SupervisorWatch:
    """In a supervised trainer: `gone()` says (one line) when the supervisor named in LLM_RUN_SUPERVISOR has
    exited, else None; it looks at most once a `period` seconds. Without the variable it never fires."""

    def __init__(self, environ: Optional[dict] = None, period: float = 1.0,
                 clock: Any = time.monotonic) -> None:
        value = (os.environ if environ is None else environ).get(SUPERVISOR_ENV, "")
        pid, _, started = value.partition(":")
        self.pid = int(pid) if pid.isdigit() else None
        self.started = started or None
        self.period, self.clock, self._next = period, clock, 0.0

    def gone(self) -> Optional[str]:
        if self.pid is None:
            return None
        now = self.clock()
        if now < self._next:
            return None
        self._next = now + self.period
        alive = _pid_alive(self.pid)
        if alive and self.started is not None:
            alive = _start_time(self.pid) == self.started  # the pid reused by another process: gone all the same
        if alive:
            return None
        return (f"the supervisor (monitor_process.py, pid {self.pid}) has exited: stopping as on SIGTERM, so that "
                "no run writes this directory unsupervised")


# what a run writes at the top of its directory: files, and the checkpoints directory
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "heartbeat", RUN_CONFIG, RUN_START, "spike.json",
             "monitor.log", "monitor_summary.json")
RUN_DIRS = (CKPT_SUBDIR,)


def check_run_dir_layout(out_dir: str, flag: str = "--out_dir") -> None:
    """RunDirUnusable (exit 2) when a name the run writes is the wrong kind of thing: `heartbeat` or
    `metrics.jsonl` a directory, `checkpoints` a file, any of them a symbolic link, or `checkpoints` a directory this
    process cannot write in (read-only; utils/writable.py). Such a run trained from scratch until its first save
    crashed (and was retried by the supervisor), or died with a traceback at the first heartbeat; now it is one
    line before anything starts."""
    for name in RUN_FILES + RUN_DIRS:
        path = os.path.join(out_dir, name)
        if not os.path.lexists(path):
            continue
        if os.path.islink(path):  # appending through it would write outside the run directory
            raise RunDirUnusable(f"{flag}={out_dir}: {path} is a symbolic link (to {os.readlink(path)}); a run writes "
                                 "only inside its own directory: replace the link with a copy of the file, or "
                                 "remove it")
        want_dir = name in RUN_DIRS
        if os.path.isdir(path) != want_dir:
            raise RunDirUnusable(f"{flag}={out_dir}: {path} is a {'file' if want_dir else 'directory'}, where the "
                                 f"run keeps its {'checkpoints (a directory)' if want_dir else name + ' (a file)'}; "
                                 "move it away or use another --out_dir")
    for name in RUN_DIRS:
        try:
            check_writable_dir(os.path.join(out_dir, name), "")
        except UnwritableDirError as e:
            raise RunDirUnusable(f"{flag}={out_dir}: {e}; the run could not save there") from None


def command_line(argv: Optional[list[str]] = None) -> str:
    """This process's command, for the lock record (what another user sees in the refusal)."""
    return " ".join([os.path.basename(sys.argv[0] or "python")] + list(sys.argv[1:] if argv is None else argv))
