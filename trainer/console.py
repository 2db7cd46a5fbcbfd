"""What a run prints to the console beside its metrics: rank 0's lines (kept above the progress bar), and when a
step's line is due.

Owns: the quiet-output rule (a piped run with the default --log_interval still prints a line every
QUIET_LINE_EVERY_S seconds).
Must never: write metrics files (utils/metrics.py does) or decide what a line says (trainer/loop.py does).
"""
from __future__ import annotations

import sys
import time
from typing import Optional

from tqdm import tqdm

from utils.dist import DistInfo


QUIET_LINE_EVERY_S = 10.0  # stdout not a terminal, --log_interval not given: a step line at least this often (s)
_last_line_at = [0.0]


def line_due(scheduled: bool, now: Optional[float] = None, quiet_lines: bool = True) -> bool:
    """Whether the loop prints this step's line: when `scheduled` (every --log_interval steps, evaluations,
    step 1), and, when stdout is not a terminal (a pipe or a log file: no progress bar there) and the user
    did not choose --log_interval (`quiet_lines`), also when no line came for QUIET_LINE_EVERY_S seconds,
    so that a piped run with the default interval is never silent for minutes."""
    now = time.time() if now is None else now
    quiet = quiet_lines and not sys.stdout.isatty() and now - _last_line_at[0] >= QUIET_LINE_EVERY_S
    if scheduled or quiet:
        _last_line_at[0] = now
        return True
    return False


def rank0_log(info: DistInfo):
    def log(msg: str) -> None:
        if info.is_main:
            tqdm.write(msg, file=sys.stdout)  # keeps the progress bar (if any) below the log lines
            sys.stdout.flush()
    return log
