"""`monitor_process.py`'s entry point: parse the command line, hold the run directory's lock (utils/run_lock.py: one
run per directory; its attempts continue under it) for the whole supervision, run it, return its exit code.
A lock that is refused, or a log file that does not fit, is one line on stderr and the refusal's exit code."""
from __future__ import annotations

import subprocess
import sys
from typing import Optional

from utils import run_lock
from utils.constants import EXIT_DISK_FULL
from utils.disk_space import DiskFullError

from monitor.config import parse_args
from monitor.supervisor import Monitor


def main(argv: Optional[list[str]] = None) -> int:
    cfg, command = parse_args(sys.argv[1:] if argv is None else argv)
    lock = None
    if cfg.out_dir:  # one run per directory: a second supervisor (or a trainer already there) is refused
        try:
            lock = run_lock.acquire(cfg.out_dir, command="monitor_process.py -- " + subprocess.list2cmdline(command))
        except run_lock.REFUSALS as e:
            full = "disk full: " if isinstance(e, DiskFullError) else ""
            print(f"monitor_process.py: error: {full}{e}", file=sys.stderr, flush=True)
            return e.exit_code
    try:
        monitor = Monitor(cfg, command, lock_token=lock.token if lock else None, lock_fd=lock.fd if lock else None)
    except DiskFullError as e:  # not even the log file fits
        print(f"monitor_process.py: error: disk full: {e}", file=sys.stderr, flush=True)
        if lock is not None:
            lock.release()
        return EXIT_DISK_FULL
    try:
        return monitor.run()
    finally:
        if lock is not None:
            lock.release()

