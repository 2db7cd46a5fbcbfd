"""Hang detection: an attempt whose <out_dir>/heartbeat and <out_dir>/metrics.jsonl (rank 0 touches them every step)
have not changed for --hang_timeout seconds, or not at all --startup_timeout seconds after it started, is hung.
Only watches: killing the tree is the supervisor's (process.py)."""
from __future__ import annotations

import os
import time
from typing import Optional

from monitor.config import MonitorConfig


def liveness_mtime(out_dir: Optional[str]) -> Optional[float]:
    """Newest mtime of heartbeat / metrics.jsonl (rank 0 touches them every step)."""
    if not out_dir:
        return None
    times = []
    for name in ("heartbeat", "metrics.jsonl"):
        try:
            times.append(os.stat(os.path.join(out_dir, name)).st_mtime)
        except OSError:
            pass
    return max(times) if times else None


class HangWatch:
    """One attempt's watch. Made before the attempt starts (what the files looked like then: a touch left by an
    earlier attempt is no sign of life), `begin()` when it has started."""

    def __init__(self, cfg: MonitorConfig) -> None:
        self.cfg = cfg
        self.alive_at_start = liveness_mtime(cfg.out_dir)
        self.started = time.time()

    def begin(self) -> None:
        self.started = time.time()

    def check(self) -> Optional[tuple[str, str]]:
        """(cause, message) once the attempt looks hung: "startup_timeout" or "hang"; None while it looks alive
        (always, with --hang_timeout=0 or no out_dir)."""
        cfg = self.cfg
        if cfg.hang_timeout <= 0 or not cfg.out_dir:
            return None
        now = time.time()
        alive = liveness_mtime(cfg.out_dir)
        if alive is None or alive == self.alive_at_start:
            if now - self.started > cfg.startup_timeout:
                return "startup_timeout", (f"no heartbeat {now - self.started:.0f}s after start (startup_timeout "
                                           f"{cfg.startup_timeout:g}s): killing the process tree")
        elif now - alive > cfg.hang_timeout:
            return "hang", (f"no heartbeat for {now - alive:.0f}s (hang_timeout {cfg.hang_timeout:g}s): "
                            f"killing the process tree")
        return None
