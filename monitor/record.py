"""The record of one supervision: its attempts (command, exit, cause, steps logged, steps lost), the summary of them
all (restarts, final status, the loss-spike events) and their report, as lines for the log and as
<out_dir>/monitor_summary.json. Records only: deciding what an exit means is restarts.py's."""
from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass, field
from typing import Optional

from utils.disk_space import writing
from utils.publish import atomic_write_text
from utils.spike_guard import format_data_steps


@dataclass
class Attempt:
    index: int
    command: list[str]
    started_at: float
    ended_at: float = 0.0
    exit_code: Optional[int] = None        # as the command returned it (None: killed by a signal)
    signal: Optional[str] = None           # name of the signal that killed it
    root_exit_code: Optional[int] = None   # a torchrun worker's code, when torchrun reported one
    cause: str = ""                        # completed / non_retryable / interrupted / crash / hang ...
    resumed_from_step: int = 0             # newest complete checkpoint when the attempt started
    first_step: Optional[int] = None       # first and last step it logged in metrics.jsonl
    last_step: Optional[int] = None
    steps_lost: int = 0                    # last_step - the step the next attempt resumed from
    made_progress: bool = False
    counted: bool = True                   # whether the restart after it counted against the budget


@dataclass
class Summary:
    command: list[str]
    out_dir: Optional[str]
    final_status: str = "running"
    reason: str = ""
    exit_code: int = 0
    restarts: int = 0
    counted_restarts: int = 0
    total_steps_lost: int = 0
    last_step: Optional[int] = None
    total_time_s: float = 0.0
    attempts: list[Attempt] = field(default_factory=list)
    # loss spikes (exit 76): {"skip_policy", "skip_data_steps", "events": [{"step", "data_step", "loss",
    # "median", "reason", "attempt", "rolled_back_to_step", "moved_aside", "reproduced", "verdict", ...}]}
    spike_guard: dict = field(default_factory=dict)



def exit_code_of(a: Attempt) -> int:
    """The code an attempt ended with, as a shell reports it (128 + the signal's number when a signal killed it)."""
    if a.exit_code:
        return a.exit_code
    if a.signal:
        return 128 + signal.Signals[a.signal].value
    return 1


def describe(a: Attempt) -> str:
    how = f"signal {a.signal}" if a.signal else f"exit code {a.exit_code}"
    if a.root_exit_code is not None:
        how += f" (torchrun worker exit code {a.root_exit_code})"
    return (f"{a.cause}, {how}, steps {a.first_step}..{a.last_step}, "
            f"{a.ended_at - a.started_at:.1f}s")


def report_lines(s: Summary) -> list[str]:
    """The summary as the lines the supervisor ends its log with."""
    lines = [f"final status: {s.final_status} ({s.reason}); exit code {s.exit_code}",
             f"restarts: {s.restarts} ({s.counted_restarts} counted), steps lost: {s.total_steps_lost}, "
             f"last step: {s.last_step}, total time: {s.total_time_s:.1f}s"]
    for a in s.attempts[:-1]:
        lines.append(f"  restart after attempt {a.index}: {a.cause} "
                     f"(exit {a.exit_code}, signal {a.signal}), last step {a.last_step}, "
                     f"steps lost {a.steps_lost}")
    for e in s.spike_guard.get("events", []):
        outcome = {"data": f"reproduced: data steps {format_data_steps(e['skipped_data_steps'])} skipped",
                   "machine": "did not reproduce: machine fault, nothing skipped"}.get(e["verdict"], e["verdict"])
        lines.append(f"  loss spike at step {e['step']} (data step {e['data_step']}): rolled back to step "
                     f"{e['rolled_back_to_step']}, {outcome}")
    return lines


def write_summary(s: Summary, path: str) -> None:
    """The summary as JSON at `path`; readers never see half of it (`<path>.tmp`, fsync, os.replace). A write that
    does not fit raises utils/disk_space.py's DiskFullError naming the file."""
    data = asdict(s)
    for a in data["attempts"]:
        a["started_at"], a["ended_at"] = round(a["started_at"], 3), round(a["ended_at"], 3)
    with writing(path):
        atomic_write_text(path, json.dumps(data, indent=2))
