"""Run observability: metrics.jsonl, optional TensorBoard and Weights & Biases, the console line,
the heartbeat, and a windowed throughput meter.

Owns: everything a run writes for humans and supervisors while it trains. Only rank 0 writes.
metrics.jsonl keeps flat keys (`loss`, `val_loss`, ...), one object per step; TensorBoard and W&B get
them grouped (`train/loss`, `eval/loss`, `dpo/reward_acc`, `perf/tokens_per_sec`, see `metric_tag`).
Samples generated during training (--sample_every, trainer/samples.py) go to samples.jsonl, one
object per (step, prompt), TensorBoard text `samples/<i>` and a W&B table `samples` (`write_samples`).
A write of metrics.jsonl, samples.jsonl, the heartbeat or wandb_run.json that does not fit (disk or quota full,
a file-size limit) raises DiskFullError naming the file (utils/disk_space.py: exit 7, never retried).
Must never: influence training, or fail the run because an optional sink (TensorBoard, wandb) is absent.
"""
from __future__ import annotations

import collections
import json
import math
import os
import time
import uuid
from typing import Any, Optional

from utils.disk_space import writing
from utils.publish import atomic_write_json, atomic_write_text

SAMPLES_FILE = "samples.jsonl"
_DPO_KEYS = {"chosen_reward", "rejected_reward", "reward_acc", "reward_margin"}
_PERF_KEYS = {"tokens_per_sec", "tokens_per_sec_avg", "mfu", "tokens_seen", "step_time",
              "mem_alloc_mib", "mem_peak_mib", "rss_mib"}


def metric_tag(key: str) -> str:
    """Grouped name of a flat metrics.jsonl key for TensorBoard / W&B dashboards."""
    if key.startswith("val_"):
        rest = key[len("val_"):]
        return f"eval/{'dpo_' if rest in _DPO_KEYS else ''}{rest}"
    if key in _DPO_KEYS:
        return f"dpo/{key}"
    if key in _PERF_KEYS or key.startswith("mem_"):
        return f"perf/{key}"
    return f"train/{key}"


class Throughput:
    """Tokens/s over the last `window` timed steps (total tokens / total time, not a mean of rates): one
    step's rate swings 10x with a busy machine; the window does not. The first `warmup` steps of the
    process are not counted (the first compiles, autotunes and JIT-compiles kernels, and allocates the
    optimizer state: at 124M on an H100 it took 40x a steady step and held the average down for 20
    steps). `rate` is None until a counted step is known."""

    def __init__(self, window: int = 20, warmup: int = 0) -> None:
        self._steps: collections.deque[tuple[float, float]] = collections.deque(maxlen=max(1, window))
        self._skip = max(0, int(warmup))
        self.rate: Optional[float] = None

    def add(self, intervals: "list[tuple[float, float]]") -> Optional[float]:
        """Count (tokens, seconds) intervals (utils.device.StepTimer.lap's); returns the window's rate."""
        for tokens, seconds in intervals:
            if self._skip > 0:
                self._skip -= 1
                continue
            self._steps.append((float(tokens), max(1e-9, float(seconds))))
        if self._steps:
            self.rate = sum(t for t, _ in self._steps) / sum(s for _, s in self._steps)
        return self.rate


def _reinit_value(wandb: Any) -> Any:
    """`reinit="finish_previous"` where wandb knows it (>= 0.19.10, which warns about the old boolean on
    every start), else the boolean that meant the same."""
    try:
        parts = [int(p) for p in str(wandb.__version__).split(".")[:3]]
    except ValueError:
        return True
    return "finish_previous" if tuple(parts + [0, 0])[:3] >= (0, 19, 10) else True


class WandbSink:
    """Weights & Biases, optional. The run id is kept in `<out_dir>/wandb_run.json`, so a resumed
    run (also after a crash, under the supervisor) continues the same W&B run; steps already
    logged before the crash are not sent again, so the W&B step stays monotonic.
    `WANDB_MODE=offline` works without network (`wandb sync` uploads later)."""

    def __init__(self, out_dir: str, project: str, run_name: str, config: Optional[dict], log: Any) -> None:
        import wandb  # ImportError is handled by the caller

        self.state_path = os.path.join(out_dir, "wandb_run.json")
        state = {}
        if os.path.exists(self.state_path):
            with open(self.state_path, encoding="utf-8") as f:
                state = json.load(f)
        run_id = state.get("id") or uuid.uuid4().hex[:12]
        self.last_step = int(state.get("last_step", -1))
        self.resumed_after = self.last_step  # steps up to here were logged by an earlier attempt
        self.skipped = 0
        self.run = wandb.init(project=project or None, name=run_name or None, id=run_id, resume="allow",
                              dir=out_dir, config=config, reinit=_reinit_value(wandb))
        self._save_state(run_id)
        log(f"[metrics] wandb run {run_id} ({'resumed' if state else 'new'}; mode "
            f"{os.environ.get('WANDB_MODE', 'online')}) in {out_dir}/wandb")

    def _save_state(self, run_id: Optional[str] = None) -> None:
        rid = run_id or self.run.id
        with writing(self.state_path):
            atomic_write_json(self.state_path, {"id": rid, "last_step": self.last_step}, indent=None,
                              sort_keys=False, newline=False)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        if step <= self.last_step:  # re-done after a resume: W&B already has this step
            self.skipped += 1
            return
        self.run.log({metric_tag(k): v for k, v in scalars.items()}, step=step)
        self.last_step = step
        self._save_state()

    def write_table(self, step: int, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        """A wandb.Table at `step` (after that step's scalars); not again for a step an earlier attempt logged."""
        if step <= self.resumed_after:
            return
        import wandb
        self.run.log({key: wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


def _decoded(raw: bytes) -> Optional[str]:
    """A line of a .jsonl file as text, None when it is not valid UTF-8 (a write cut inside a character)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def truncate_metrics_after(path: str, step: int, log: Any = print) -> int:
    """Keep the rows of metrics.jsonl up to `step` (where a resumed run continues) and move the rows
    after it, written by the attempt that crashed and now to be re-done, to
    `metrics.jsonl.after_step<step>.<time>.old` beside it: the file then holds each step once.
    A torn last line goes with them, also one cut inside a multi-byte UTF-8 character (kept byte for
    byte). Returns the number of rows moved aside."""
    if not os.path.isfile(path):
        return 0
    keep: list[str] = []
    aside: list[bytes] = []
    with open(path, "rb") as f:  # bytes: a crash can cut a multi-byte UTF-8 character (ensure_ascii=False)
        for raw in f:
            if not raw.strip():
                continue
            text = _decoded(raw)
            try:
                rec = json.loads(text) if text is not None else None
                later = text is None or (isinstance(rec, dict) and int(rec.get("step", 0)) > step)
            except (json.JSONDecodeError, TypeError, ValueError):
                later = True  # torn or foreign: not a row of the resumed run
            if later:  # set aside byte for byte, torn characters included
                aside.append(raw if raw.endswith(b"\n") else raw + b"\n")
            else:
                keep.append(text if text.endswith("\n") else text + "\n")
    if not aside:
        return 0
    old = f"{path}.after_step{step}.{int(time.time())}.old"
    with writing(old), open(old, "wb") as f:
        f.writelines(aside)
    with writing(path):
        atomic_write_text(path, "".join(keep))
    log(f"[metrics] resumed at step {step}: {len(aside)} row(s) of the interrupted attempt moved to {old}")
    return len(aside)


class MetricsLogger:
    def __init__(self, out_dir: str, enabled: bool = True, tensorboard: bool = False,
                 log: Any = print, wandb: bool = False, wandb_project: str = "", wandb_run_name: str = "",
                 run_config: Optional[dict] = None, resume_step: Optional[int] = None) -> None:
        """resume_step: the step a resumed run continues after; rows logged past it by the attempt
        that crashed leave metrics.jsonl (kept aside) and TensorBoard (purge_step), so each step is
        logged once. W&B keeps its own last step (WandbSink)."""
        self.enabled = enabled
        self.path = os.path.join(out_dir, "metrics.jsonl")
        self.samples_path = os.path.join(out_dir, SAMPLES_FILE)
        self.heartbeat_path = os.path.join(out_dir, "heartbeat")
        self.log = log
        self.tb = None
        self.wandb: Optional[WandbSink] = None
        if enabled and resume_step is not None:
            truncate_metrics_after(self.path, int(resume_step), log)
            truncate_metrics_after(self.samples_path, int(resume_step), log)
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                purge = None if resume_step is None else int(resume_step) + 1
                self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=purge)
            except ImportError:
                log("[metrics] tensorboard not installed; metrics go to metrics.jsonl only "
                    "(pip install tensorboard to enable)")
        if enabled and wandb:
            try:
                self.wandb = WandbSink(out_dir, wandb_project, wandb_run_name, run_config, log)
            except ImportError:
                log("[metrics] wandb not installed; metrics go to metrics.jsonl only (pip install wandb)")

    def heartbeat(self) -> None:
        """Touched every step; monitor_process.py treats a stale mtime as a hang."""
        if not self.enabled:
            return
        with writing(self.heartbeat_path):
            with open(self.heartbeat_path, "a"):
                pass
            os.utime(self.heartbeat_path, None)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        clean.setdefault("time", time.time())
        with writing(self.path), open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean, ensure_ascii=False) + "\n")
        scalars = {k: float(v) for k, v in clean.items()
                   if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        step = int(record.get("step", 0))
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(metric_tag(k), v, step)
        if self.wandb is not None:
            self.wandb.write(step, scalars)

    def write_samples(self, records: list[dict[str, Any]]) -> None:
        """Samples of one step (trainer/samples.py: {"step", "prompt", "completion", ...}): a console line
        each, one samples.jsonl object each, TensorBoard text `samples/<i>` (prompt i), a W&B table `samples`."""
        if not self.enabled or not records:
            return
        now = time.time()
        with writing(self.samples_path), open(self.samples_path, "a", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(dict(r, time=now), ensure_ascii=False) + "\n")
        for i, r in enumerate(records):
            self.log(format_sample(r))
            if self.tb is not None:
                self.tb.add_text(f"samples/{i}", f"**{r['prompt']}** {r['completion']}", int(r["step"]))
        if self.wandb is not None:
            self.wandb.write_table(int(records[0]["step"]), "samples", ["prompt", "completion"],
                                   [[r["prompt"], r["completion"]] for r in records])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl; a torn last line (crash mid-write) is ignored."""
    out = []
    with open(path, "rb") as f:
        for raw in f:
            line = _decoded(raw)
            if line is None or not line.strip():
                continue  # a torn UTF-8 character: a crashed write, like a torn JSON line
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


def format_duration(seconds: float) -> str:
    """h:mm:ss (days as `Nd h:mm:ss`)."""
    s = int(round(max(0.0, seconds)))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h}:{m:02d}:{s:02d}"


def format_line(rec: dict[str, Any], total: Optional[int] = None, elapsed: Optional[float] = None,
                eta: Optional[float] = None) -> str:
    """The console line: `step N/total`, the step's figures, then elapsed and ETA when given (log files and
    pipes have no progress bar to show them). Throughput is the windowed average when present; an MFU
    over an estimated (measured) peak is printed as `mfu~`."""
    parts = [f"step {rec['step']}" + (f"/{total}" if total else "")]
    tps = "tokens_per_sec_avg" if isinstance(rec.get("tokens_per_sec_avg"), (int, float)) else "tokens_per_sec"
    for key, fmt in (("loss", "{:.4f}"), ("mtp_loss", "{:.4f}"), ("val_loss", "{:.4f}"), ("lr", "{:.2e}"),
                     ("grad_norm", "{:.3f}"),
                     (tps, "{:.0f}"), ("mfu", "{:.2%}"), ("reward_acc", "{:.3f}"), ("val_reward_acc", "{:.3f}"),
                     ("val_reward", "{:.3f}"),
                     ("mem_peak_mib", "{:.0f}MiB"), ("rss_mib", "{:.0f}MiB")):
        v = rec.get(key)
        if isinstance(v, (int, float)):
            name = {"tokens_per_sec_avg": "tokens/s", "tokens_per_sec": "tokens/s"}.get(key, key)
            if key == "mfu" and rec.get("mfu_is_estimate"):
                name = "mfu~"
            parts.append(f"{name} " + fmt.format(v))
    if elapsed is not None:
        parts.append(f"elapsed {format_duration(elapsed)}")
    if eta is not None:
        parts.append(f"eta {format_duration(eta)}")
    return " | ".join(parts)


def format_sample(record: dict[str, Any]) -> str:
    """The console line of one sample (trainer/samples.py): `[sample step N] "prompt" -> "continuation"`
    (JSON-quoted: one line, and a leading space of the continuation stays visible)."""
    q = lambda s: json.dumps(s, ensure_ascii=False)  # noqa: E731
    return f"[sample step {record['step']}] {q(record['prompt'])} -> {q(record['completion'])}"
