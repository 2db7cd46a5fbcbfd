"""When and how the supervisor restarts: what an attempt's exit means, the backoff before the next attempt, and the
command it runs (the original one, with `--resume=always` in place of `--resume=never` and the data steps a
reproduced loss spike skips). Pure functions of the command and the attempt: never starts or signals anything."""
from __future__ import annotations

import subprocess
from typing import Optional

from utils.checkpoint_layout import RUN_START
from utils.constants import EXIT_INTERRUPTED, EXIT_LOSS_SPIKE, EXIT_OK, NON_RETRYABLE_EXIT_CODES
from utils.spike_guard import format_data_steps

from monitor.record import Attempt
from monitor.run_files import run_has_started

RESUME_FLAG = "--resume"      # the trainer's: auto (default) | always | never
RESUME_VALUE = "always"
SKIP_FLAG = "--skip_data_steps"


def flag_value(command: list[str], key: str) -> Optional[str]:
    """Value of `key=v` or `key v` in the command; the last one wins, as in utils/configurator.py."""
    value = None
    for i, arg in enumerate(command):
        if arg.startswith(key + "="):
            value = arg[len(key) + 1:]
        elif arg == key and i + 1 < len(command):
            value = command[i + 1]
    return value


def with_flag(command: list[str], key: str, value: str) -> list[str]:
    """The command with every `key=v` / `key v` replaced by `key=value` (appended if absent).

    Appending at the end is right under torchrun too: everything after the script goes to it.
    """
    out: list[str] = []
    found = False
    skip_next = False
    for i, arg in enumerate(command):
        if skip_next:
            skip_next = False
            continue
        if arg.startswith(key + "="):
            out.append(f"{key}={value}")
            found = True
        elif arg == key and i + 1 < len(command):
            out.append(f"{key}={value}")
            found = skip_next = True
        else:
            out.append(arg)
    if not found:
        out.append(f"{key}={value}")
    return out


def with_resume(command: list[str]) -> list[str]:
    """The command that continues the run: the command itself, since the trainer continues the run in
    its out_dir unless told `--resume=never` (its default is auto; always and --init_from=resume
    continue too); a command that says `--resume=never` gets `--resume=always` in its place."""
    if flag_value(command, RESUME_FLAG) == "never":
        return with_flag(command, RESUME_FLAG, RESUME_VALUE)
    return list(command)



def classify(a: Attempt) -> str:
    """The cause of an attempt's end from its exit: completed / non_retryable / interrupted / loss_spike / signal /
    crash (a torchrun worker's code, when torchrun reported one, counts as the exit code)."""
    code = a.root_exit_code if a.root_exit_code is not None else a.exit_code
    if a.exit_code == EXIT_OK:
        return "completed"
    if code in NON_RETRYABLE_EXIT_CODES:
        return "non_retryable"
    if code == EXIT_INTERRUPTED:
        return "interrupted"
    if code == EXIT_LOSS_SPIKE:
        return "loss_spike"
    return "signal" if a.signal else "crash"


def backoff_delay(base: float, cap: float, stalled_in_a_row: int) -> float:
    """Seconds before the next restart: `base`, doubled for every attempt in a row before it that made no progress,
    at most `cap`."""
    return min(cap, base * 2 ** max(0, stalled_in_a_row - 1))


def restart_command(command: list[str], out_dir: Optional[str], skip_steps: set[int]) -> tuple[list[str], str]:
    """(the command of the next attempt, how it was made, for the log)."""
    restart = with_resume(command)
    if restart == command:
        how = "the original command, unchanged (the trainer continues the run in its out_dir by itself)"
    elif out_dir and not run_has_started(out_dir):
        # --resume=never, and it died in start-up before the trainer recorded how the run starts:
        # --resume=always would find nothing (exit 2). Start it again the way the user did.
        restart = list(command)
        how = (f"the original command, unchanged (no {RUN_START} and no checkpoint in the out_dir: the run "
               "stopped before it recorded how it started)")
    else:
        how = f"{RESUME_FLAG}={RESUME_VALUE} in place of the command's {RESUME_FLAG}=never"
    if skip_steps:
        value = format_data_steps(skip_steps)
        restart = with_flag(restart, SKIP_FLAG, value)
        how += f" and {SKIP_FLAG}={value}"
    return restart, f"{how}: {subprocess.list2cmdline(restart)}"
