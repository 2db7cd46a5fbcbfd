"""The processes below a pid, read from /proc (Linux), and how to end all of them.

A child started in its own session (torchrun's workers, a bench row that owns its compile workers) is in
another process group than its parent: killing the parent's group leaves it running, orphaned. The
supervisor (monitor_process.py) and the GPU report (scripts/gpu_report.py) end a tree with `kill_tree`,
which stops every process of it first (a stopped process cannot start another) and then kills them all.
`become_subreaper` makes orphans below this process its children rather than init's, so that a
process whose parent died before anyone killed it can still be found below this one (its child now).
Where /proc is missing (not Linux) the table is empty: only the root's own group is signalled.
"""
from __future__ import annotations

import collections
import ctypes
import os
import signal
from typing import NamedTuple, Optional

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


class Proc(NamedTuple):
    ppid: int
    pgid: int
    state: str  # "R", "S", "T" (stopped), "Z" (zombie: dead, not yet waited for), ...


def process_info(pid: int) -> Optional[Proc]:
    """pid's parent, group and state from /proc/<pid>/stat; None once it is gone (or without /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces or parentheses.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return Proc(int(fields[1]), int(fields[2]), fields[0].decode("ascii", "replace"))
    except (IndexError, ValueError):
        return None


def process_table() -> dict[int, Proc]:
    """pid -> Proc for every process /proc shows. Empty where /proc is unavailable."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    return {pid: info for pid in pids if (info := process_info(pid)) is not None}


def descendants(root_pid: int, table: dict[int, Proc] | None = None) -> list[int]:
    """Every process below root_pid (children before their own children), zombies included."""
    table = process_table() if table is None else table
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, p in table.items():
        children[p.ppid].append(pid)
    found, stack = [], [root_pid]
    while stack:
        for child in sorted(children.get(stack.pop(), [])):
            found.append(child)
            stack.append(child)
    return found


def descendant_groups(root_pid: int) -> set[int]:
    """Process groups of root_pid's descendants. torchrun starts each worker in its own session,
    so killing torchrun's group alone would orphan hung workers."""
    table = process_table()
    return {table[pid].pgid for pid in descendants(root_pid, table)}


def command_line(pid: int, limit: int = 200) -> str:
    """The process's argv joined by spaces, cut to `limit` characters; "" once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return ""
    return b" ".join(a for a in argv if a).decode("utf-8", "replace")[:limit]


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(root_pid: int, rounds: int = 5) -> list[int]:
    """SIGKILL root_pid, its group, every descendant and every descendant's group (never this process's own
    group). Each round stops (SIGSTOP) the processes found so far, so none of them can start another, and
    looks again, until a round finds nothing new; then everything found is killed. Returns the descendants
    killed (root_pid not included)."""
    own_group = os.getpgrp()
    found: list[int] = []
    seen = {root_pid}
    _signal(root_pid, signal.SIGSTOP)
    for _ in range(rounds):
        new = [pid for pid in descendants(root_pid) if pid not in seen]
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        seen.update(new)
        found += new
    table = process_table()
    groups = {table[pid].pgid for pid in [root_pid, *found] if pid in table}
    for pid in [root_pid, *found]:
        _signal(pid, signal.SIGKILL)
    for pgid in groups - {own_group, 0}:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return found


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux prctl PR_SET_CHILD_SUBREAPER): a grandchild
    whose parent died becomes this process's child, where `descendants(os.getpid())` finds it. False where
    the call is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
