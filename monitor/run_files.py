"""Reading a run's progress from the files the trainer writes (metrics.jsonl, checkpoints/step_*/, run_start.json)
and from its output (torchrun's failure report). Read-only: nothing here writes, moves or signals."""
from __future__ import annotations

import json
import os
import re
from typing import Optional

from utils.checkpoint_layout import COMPLETE_MARKER, RUN_START, checkpoint_root, parse_step
from utils.run_dir import misnamed_step


def read_steps(metrics_path: str, offset: int) -> tuple[list[int], int]:
    """Steps logged in metrics.jsonl from byte `offset` on, and the offset after the last full line.

    A line cut short by a crash is ignored; a file shorter than offset (recreated) is read from 0.
    """
    try:
        size = os.path.getsize(metrics_path)
    except OSError:
        return [], 0
    if size < offset:
        offset = 0
    steps: list[int] = []
    with open(metrics_path, "rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return steps, offset + end


def file_identity(path: Optional[str]) -> Optional[tuple[int, int]]:
    """(device, inode) of a file, None when it does not exist: tells an append from a replacement."""
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if st else None


def newest_checkpoint_step(out_dir: Optional[str]) -> int:
    """Step of the newest checkpoints/step_XXXXXXXX/ holding COMPLETE — what a resume loads (0: none)."""
    if not out_dir:
        return 0
    root = checkpoint_root(out_dir)
    best = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        step = parse_step(name)
        if step is not None and os.path.exists(os.path.join(root, name, COMPLETE_MARKER)) and \
                misnamed_step(os.path.join(root, name), step) is None:  # a copy under another name is not one
            best = max(best, step)
    return best


def checkpoint_dirs(out_dir: str) -> list[tuple[int, str]]:
    """(step, name) of every checkpoints/step_XXXXXXXX/ directory, complete or not, oldest first."""
    try:
        names = os.listdir(checkpoint_root(out_dir))
    except OSError:
        return []
    found = [(step, n) for n in names if (step := parse_step(n)) is not None]
    return sorted(found)


def run_has_started(out_dir: str) -> bool:
    """Whether the trainer recorded this run yet: run_start.json (written before the first step) or any
    checkpoints/step_* directory. Without either, `--resume=always` has nothing to continue."""
    return os.path.exists(os.path.join(out_dir, RUN_START)) or bool(checkpoint_dirs(out_dir))


def loss_at_step(metrics_path: str, step: int) -> Optional[float]:
    """The last loss metrics.jsonl logged for `step` (None when it has none)."""
    loss = None
    try:
        with open(metrics_path, "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("step") == step and isinstance(rec.get("loss"), (int, float)):
                    loss = float(rec["loss"])
    except OSError:
        pass
    return loss


def torchrun_root_cause_exit_code(output_tail: str) -> Optional[int]:
    """torchrun exits 1 whatever its workers returned; its report names the first failure's code."""
    if "ChildFailedError" not in output_tail:
        return None
    block = output_tail.rsplit("Root Cause", 1)[-1]
    m = re.search(r"exitcode\s*:\s*(-?\d+)", block)
    return int(m.group(1)) if m else None
