"""Run observability: metrics.jsonl, optional TensorBoard, the console line, the heartbeat.

Owns: everything a run writes for humans and supervisors while it trains. Only rank 0 writes.
Must never: influence training, or fail the run because an optional sink (TensorBoard) is absent.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any


class MetricsLogger:
    def __init__(self, out_dir: str, enabled: bool = True, tensorboard: bool = False,
                 log: Any = print) -> None:
        self.enabled = enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.heartbeat_path = os.path.join(out_dir, "heartbeat")
        self.log = log
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
            except ImportError:
                log("[metrics] tensorboard not installed; metrics go to metrics.jsonl only "
                    "(pip install tensorboard to enable)")

    def heartbeat(self) -> None:
        """Touched every step; monitor_process.py treats a stale mtime as a hang."""
        if not self.enabled:
            return
        with open(self.heartbeat_path, "a"):
            pass
        os.utime(self.heartbeat_path, None)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        clean.setdefault("time", time.time())
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean, ensure_ascii=False) + "\n")
        if self.tb is not None:
            step = int(record.get("step", 0))
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl; a torn last line (crash mid-write) is ignored."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def dedupe_by_step(records: list[dict[str, Any]], key: str = "loss") -> dict[int, dict[str, Any]]:
    """step -> the last record of that step carrying `key` (a resumed run re-logs some steps)."""
    out: dict[int, dict[str, Any]] = {}
    for r in records:
        if key in r and "step" in r:
            out[int(r["step"])] = r
    return out


def format_line(rec: dict[str, Any]) -> str:
    parts = [f"step {rec['step']}"]
    for key, fmt in (("loss", "{:.4f}"), ("val_loss", "{:.4f}"), ("lr", "{:.2e}"), ("grad_norm", "{:.3f}"),
                     ("tokens_per_sec", "{:.0f}"), ("mfu", "{:.2%}"), ("reward_acc", "{:.3f}"), ("val_reward_acc", "{:.3f}"),
                     ("mem_peak_mib", "{:.0f}MiB"), ("rss_mib", "{:.0f}MiB")):
        v = rec.get(key)
        if isinstance(v, (int, float)):
            parts.append(f"{key} " + fmt.format(v))
    return " | ".join(parts)

