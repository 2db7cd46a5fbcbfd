"""The loss-spike guard: the running-median detector the trainer checks every step, the skip-list
syntax (`--skip_data_steps=12,13` or `10-13`), and the `<out_dir>/spike.json` record the trainer
writes and monitor_process.py reads.

A spike is a step loss above `factor` x the median of the losses of the previous `window` steps, or
a non-finite loss. Nothing is judged until `window` losses were seen (the warm-up); the window is
saved in checkpoints (`state_dict`), so a resumed run judges every step exactly as an uninterrupted
run would, and a replay of the same steps reaches the same verdict.

A "data step" is one optimizer step's worth of data in the run's data stream: data step N is the
global batch that optimizer step N reads when nothing was skipped. Skipping data step N means
drawing it from the loader and discarding it; every later step then reads the data after it.

Must never: import torch or anything of the training stack (the supervisor imports this module),
or change the data order by itself (the trainer does the skipping).
"""
from __future__ import annotations

import collections
import json
import math
import os
import statistics
from typing import Iterable, Optional

from utils.disk_space import writing
from utils.publish import atomic_write_text

SPIKE_FILE = "spike.json"                  # written by the trainer when the guard stops the run
AFTER_SPIKE_DIR = "checkpoints_after_spike"  # where the supervisor moves checkpoints it must not resume


# ---------------------------------------------------------------------------- the detector

class SpikeDetector:
    """Running median over the last `window` step losses; `check` says whether a loss is a spike."""

    def __init__(self, factor: float, window: int) -> None:
        if not (math.isfinite(factor) and factor > 1.0):
            raise ValueError(f"spike factor {factor}: must be a finite number > 1")
        if window < 1:
            raise ValueError(f"spike window {window}: must be >= 1")
        self.factor, self.window = float(factor), int(window)
        self.recent: collections.deque[float] = collections.deque(maxlen=self.window)

    @property
    def warmed_up(self) -> bool:
        return len(self.recent) == self.window

    def median(self) -> Optional[float]:
        return statistics.median(self.recent) if self.recent else None

    def check(self, loss: float, nonfinite_is_spike: bool = True) -> Optional[dict]:
        """None for a normal loss (which then joins the window), else {"reason", "median", "threshold"}
        (the spike does not join the window). A non-finite loss is a spike at any time, warm-up
        included, unless `nonfinite_is_spike` is False (fp16: the loss scaler skips such steps), when
        it is ignored altogether."""
        med = self.median()
        if not math.isfinite(loss):
            if not nonfinite_is_spike:
                return None
            return {"reason": "non_finite", "median": med, "threshold": None}
        if self.warmed_up and loss > self.factor * med:
            return {"reason": "spike", "median": med, "threshold": self.factor * med}
        self.recent.append(float(loss))
        return None

    def state_dict(self) -> dict:
        return {"factor": self.factor, "window": self.window, "recent": list(self.recent)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the losses of a checkpoint (the newest `window` of them when the window changed)."""
        self.recent.clear()
        for v in list(state.get("recent", []))[-self.window:]:
            self.recent.append(float(v))


# ---------------------------------------------------------------------------- the skip list

def parse_data_steps(text: str) -> list[int]:
    """'12,13' / '10-13' / '3,10-12' / '' -> sorted unique data steps (each >= 1). ValueError on
    anything else, naming the bad part."""
    out: set[int] = set()
    for part in str(text or "").replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise ValueError(f"{part!r} is not a step or a range like 10-13") from None
        if a < 1 or b < a:
            raise ValueError(f"{part!r}: steps start at 1 and a range goes up (10-13)")
        out.update(range(a, b + 1))
    return sorted(out)


def format_data_steps(steps: Iterable[int]) -> str:
    """The inverse of parse_data_steps, with runs of consecutive steps written as ranges."""
    s = sorted(set(int(x) for x in steps))
    parts, i = [], 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        parts.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(parts)


# ---------------------------------------------------------------------------- the record

def write_spike_record(out_dir: str, record: dict) -> str:
    """Atomically write <out_dir>/spike.json (non-finite numbers as strings: strict JSON)."""
    clean = {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    path = os.path.join(out_dir, SPIKE_FILE)
    with writing(path):  # DiskFullError naming spike.json when it does not fit (exit 7)
        atomic_write_text(path, json.dumps(clean, indent=1))
    return path


def read_spike_record(out_dir: str) -> Optional[dict]:
    """The record of the last spike, or None when there is none (or it is unreadable)."""
    try:
        with open(os.path.join(out_dir, SPIKE_FILE), encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("step"), int) or not isinstance(rec.get("data_step"), int):
        return None
    return rec
