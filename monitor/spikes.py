"""Loss spikes (the trainer's exit 76, the step in <out_dir>/spike.json): the supervisor moves the checkpoints at or
after the spike aside, into checkpoints_after_spike/ (never deleted), and replays from the newest one before it; a
spike that comes back at the same step is the data's fault and its data window is skipped (`--skip_data_steps=` on
every later restart), one that does not is the machine's and is only logged. Moves checkpoints only: restarting
is the supervisor's."""
from __future__ import annotations

import os
from typing import Callable, Optional

from utils.checkpoint_layout import checkpoint_root
from utils.constants import EXIT_LOSS_SPIKE
from utils.spike_guard import AFTER_SPIKE_DIR, SPIKE_FILE, format_data_steps, parse_data_steps, read_spike_record

from monitor.config import MonitorConfig
from monitor.record import Attempt
from monitor.restarts import SKIP_FLAG, flag_value
from monitor.run_files import checkpoint_dirs, loss_at_step, newest_checkpoint_step


def move_checkpoints_aside(out_dir: str, first_step: int) -> list[str]:
    """Move every checkpoints/step_N with N >= first_step into checkpoints_after_spike/ (never deleted;
    a name already there gets a .1, .2, ... suffix). Returns the new paths, relative to out_dir."""
    moved = []
    for step, name in checkpoint_dirs(out_dir):
        if step < first_step:
            continue
        aside = os.path.join(out_dir, AFTER_SPIKE_DIR)
        os.makedirs(aside, exist_ok=True)
        dest, n = os.path.join(aside, name), 0
        while os.path.exists(dest):
            n += 1
            dest = os.path.join(aside, f"{name}.{n}")
        try:
            os.rename(os.path.join(checkpoint_root(out_dir), name), dest)
        except FileNotFoundError:  # another node's monitor moved it first
            continue
        moved.append(os.path.relpath(dest, out_dir))
    return moved



class SpikeGuard:
    """The supervision's loss-spike state: the data steps every restart skips (those the command already skips,
    and the windows of spikes that reproduced), the event being replayed, and `record` (the summary's
    spike_guard: the policy, the skipped steps, every event)."""

    def __init__(self, cfg: MonitorConfig, command: list[str], say: Callable[[str], None]) -> None:
        self.cfg, self.say = cfg, say
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl") if cfg.out_dir else None
        try:  # data steps the command already skips; spikes that reproduce add to them
            self.skip_steps: set[int] = set(parse_data_steps(flag_value(command, SKIP_FLAG) or ""))
        except ValueError:
            self.skip_steps = set()  # the trainer names the bad value itself (exit 2)
        self.pending_spike: Optional[dict] = None  # the event being replayed
        self.record = {"skip_policy": cfg.spike_skip, "skip_data_steps": sorted(self.skip_steps), "events": []}

    def settle_replay(self, a: Attempt) -> None:
        """An attempt that logged the replayed spike step with no spike: the machine's fault."""
        p = self.pending_spike
        if p is None or a.last_step is None or a.last_step < p["step"]:
            return
        p.update(reproduced=False, verdict="machine", replay_attempt=a.index,
                 replay_loss=loss_at_step(self.metrics_path, p["step"]) if self.metrics_path else None)
        self.pending_spike = None
        self.say(f"the loss spike at step {p['step']} did NOT reproduce on the replay (loss {p['replay_loss']}): "
                 "blamed on the machine (a transient hardware or software fault); no data skipped")

    def on_spike(self, a: Attempt) -> Optional[tuple[str, str, int]]:
        """Exit 76: roll back before the spike and replay it, or, when the replay spiked at the same
        step, skip its data window. Returns (status, reason, code) when the run must stop instead."""
        g, out_dir = self.record, self.cfg.out_dir
        rec = read_spike_record(out_dir) if out_dir else None
        if rec is None:
            return ("non_retryable", f"exit code {EXIT_LOSS_SPIKE} (loss spike) but no readable {SPIKE_FILE} in the "
                    "out_dir: the monitor cannot tell which checkpoints come after the spike", EXIT_LOSS_SPIKE)
        step, data_step = rec["step"], rec["data_step"]
        p = self.pending_spike
        if p is not None and p["step"] == step:
            # Reproduced: training is deterministic, so the data (with the weights it met) is to blame.
            resumed = rec.get("resumed_from") or {}
            from_step, from_data = int(resumed.get("step", 0)), int(resumed.get("data_step", 0))
            window = [data_step] if self.cfg.spike_skip == "step" else list(range(from_data + 1, data_step + 1))
            # since_checkpoint: the window starts at the checkpoint the replay resumed from, so resume
            # exactly there: a later checkpoint would already have trained on part of the window
            moved = move_checkpoints_aside(out_dir, step if self.cfg.spike_skip == "step" else from_step + 1)
            self.skip_steps |= set(window)
            g["skip_data_steps"] = sorted(self.skip_steps)
            p.update(reproduced=True, verdict="data", replay_attempt=a.index, replay_loss=rec.get("loss"),
                     skipped_data_steps=window, continued_from_step=newest_checkpoint_step(out_dir))
            p["moved_aside"] += moved
            self.pending_spike = None
            self.say(f"the loss spike at step {step} reproduced on the replay (loss {rec.get('loss')}): the data is to "
                     f"blame; skipping data steps {format_data_steps(window)} (--spike_skip={self.cfg.spike_skip}) "
                     f"and continuing from checkpoint step {p['continued_from_step']}"
                     + (f" (moved aside: {', '.join(moved)})" if moved else ""))
            return None
        if p is not None:  # the replay spiked elsewhere: the first one did not come back
            p.update(reproduced=False, verdict="machine", replay_attempt=a.index,
                     note=f"the replay spiked at step {step} instead")
            self.pending_spike = None
            self.say(f"the loss spike at step {p['step']} did NOT reproduce on the replay (it spiked at step {step} "
                     "instead): blamed on the machine; handling the new spike")
        if len(g["events"]) >= self.cfg.max_spike_events:
            return ("gave_up", f"loss spike at step {step} after {len(g['events'])} handled spikes "
                    f"(--max_spike_events={self.cfg.max_spike_events})", EXIT_LOSS_SPIKE)
        moved = move_checkpoints_aside(out_dir, step)
        back_to = newest_checkpoint_step(out_dir)
        event = {"step": step, "data_step": data_step, "loss": rec.get("loss"), "median": rec.get("median"),
                 "reason": rec.get("reason"), "attempt": a.index, "rolled_back_to_step": back_to,
                 "moved_aside": moved, "reproduced": None, "verdict": "replaying", "skipped_data_steps": []}
        g["events"].append(event)
        self.pending_spike = event
        self.say(f"loss spike at step {step} (data step {data_step}; {rec.get('reason')}: loss {rec.get('loss')}, "
                 f"running median {rec.get('median')}): rolled back to checkpoint step {back_to}"
                 + (f" (moved aside: {', '.join(moved)})" if moved else "")
                 + f"; replaying steps {back_to + 1}..{step} once to see whether it reproduces")
        return None
