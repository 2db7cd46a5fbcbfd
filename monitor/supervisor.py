"""The supervision loop: one attempt of the training command after another (process.py starts and kills them),
each watched for hangs (hang.py) and progress (run_files.py), its end classified (restarts.py), a loss spike handed
to spikes.py, and then either the end of the run or a restart after a backoff; SIGINT/SIGTERM are forwarded to the
training's process group and end the supervision with no restart. Writes only its log and summary (record.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Optional

from utils import run_lock
from utils.constants import EXIT_DISK_FULL, EXIT_INTERRUPTED, EXIT_OK
from utils.disk_space import DiskFullError
from utils.run_lock import TOKEN_ENV

from monitor.config import MonitorConfig
from monitor.hang import HangWatch
from monitor.process import Child, RunLog
from monitor.record import Attempt, Summary, describe, exit_code_of, report_lines, write_summary
from monitor.restarts import backoff_delay, classify, restart_command
from monitor.run_files import file_identity, newest_checkpoint_step, read_steps, torchrun_root_cause_exit_code
from monitor.spikes import SpikeGuard


class Monitor:
    """One supervision: attempts of the command, one after another, until one ends the run."""

    def __init__(self, cfg: MonitorConfig, command: list[str], lock_token: Optional[str] = None,
                 lock_fd: Optional[int] = None) -> None:
        self.cfg = cfg
        # the run directory's lock (utils/run_lock.py) is ours; every attempt continues under it, holds it too
        # (its locked descriptor, inherited: an attempt that outlives us keeps the directory locked) and watches
        # that we are alive (it stops as on SIGTERM when we are not)
        self.child_env = dict(os.environ, **{TOKEN_ENV: lock_token}, **run_lock.supervisor_env()) \
            if lock_token else None
        self.pass_fds = (lock_fd,) if lock_fd is not None else ()
        self.command = command
        self.summary = Summary(command=command, out_dir=cfg.out_dir)
        self.stop_signal: Optional[int] = None
        self.stop_requests = 0
        self.stop_announced = False
        self.child: Optional[Child] = None
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl") if cfg.out_dir else None
        self.spikes = SpikeGuard(cfg, command, self.say)
        self.summary.spike_guard = self.spikes.record
        self.log = RunLog(cfg.log_file)  # DiskFullError when not even the file fits (main: exit 7)

    # -- messages -------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        line = f"[monitor {time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}\n"
        sys.stderr.write(line)
        sys.stderr.flush()
        self.log.write(line.encode())

    # -- signals --------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _frame) -> None:
        # Runs in the main thread between bytecodes: only flags and kill(2) here, no logging
        # (the main thread may be holding the log's lock or be inside a buffered write).
        self.stop_requests += 1
        if self.stop_signal is None:
            self.stop_signal = signum
        child = self.child
        if child is None or child.proc.poll() is not None:
            return
        if self.stop_requests == 1:
            child.forward(signum)
        else:  # a second signal means "now": do not wait for the checkpoint
            child.killed_by_monitor = True
            child.signal_groups(signal.SIGKILL)

    # -- one attempt ----------------------------------------------------------------------------
    def run_attempt(self, attempt: Attempt) -> None:
        cfg = self.cfg
        steps_before, offset = read_steps(self.metrics_path, 0) if self.metrics_path else ([], 0)
        metrics_file = file_identity(self.metrics_path)
        best_step_before = max(steps_before, default=0)
        ckpt_before = newest_checkpoint_step(cfg.out_dir)
        hang = HangWatch(cfg)  # what heartbeat/metrics looked like before the attempt
        self.say(f"attempt {attempt.index}: {subprocess.list2cmdline(attempt.command)}")
        self.child = child = Child(attempt.command, self.log, env=self.child_env, pass_fds=self.pass_fds)
        hang.begin()
        hang_cause = ""
        while child.proc.poll() is None:
            child.track_descendants()
            if self.stop_signal is not None:
                if not child.stop_forwarded:  # the signal came before the child existed
                    child.forward(self.stop_signal)
                self.announce_stop()
            hung = None if hang_cause else hang.check()
            if hung:
                hang_cause, why = hung
                self.say(why)
                child.kill_tree(cfg.kill_grace, cfg.poll_interval)
            time.sleep(cfg.poll_interval)
        rc = child.reap()
        attempt.ended_at = time.time()
        attempt.exit_code = rc if rc >= 0 else None
        attempt.signal = signal.Signals(-rc).name if rc < 0 else None
        attempt.root_exit_code = torchrun_root_cause_exit_code(child.output_tail()) if rc == 1 else None
        if self.metrics_path:
            if file_identity(self.metrics_path) != metrics_file:
                # Replaced: a resume moves the rows after its step aside (utils/metrics.py), so the offset
                # means nothing; this attempt's rows are those after the step it resumed from.
                steps = [x for x in read_steps(self.metrics_path, 0)[0] if x > attempt.resumed_from_step]
            else:
                steps, _ = read_steps(self.metrics_path, offset)
            if steps:
                attempt.first_step, attempt.last_step = steps[0], steps[-1]
            attempt.made_progress = max(steps, default=0) > best_step_before
        attempt.made_progress |= newest_checkpoint_step(cfg.out_dir) > ckpt_before
        # A finished run is finished whatever else happened (trap 15); after that, a stop
        # requested by the operator wins over everything: never restart after it.
        if attempt.exit_code == EXIT_OK:
            attempt.cause = "completed"
        elif self.stop_signal is not None:
            attempt.cause = "stopped"
        else:
            attempt.cause = hang_cause or classify(attempt)

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> int:
        t0 = time.time()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        s = self.summary
        self.say(f"supervising (out_dir={self.cfg.out_dir}, log={self.cfg.log_file}, "
                 f"max_restarts={self.cfg.max_restarts})")
        if not self.cfg.out_dir:
            self.say("no out_dir known: hang detection, progress and steps-lost accounting are off")
        command, stalled_in_a_row = self.command, 0
        while True:
            if self.stop_signal is not None:  # arrived before the first start
                self.finish("stopped", "stop signal before the training started", EXIT_INTERRUPTED)
                break
            if self.log_is_full():  # nothing is started on a full disk
                break
            attempt = Attempt(index=len(s.attempts), command=command, started_at=time.time(),
                              resumed_from_step=newest_checkpoint_step(self.cfg.out_dir) if s.attempts else 0)
            s.attempts.append(attempt)
            try:
                self.run_attempt(attempt)
            except OSError as e:  # the executable is missing or not runnable: retrying cannot help
                attempt.cause, attempt.ended_at = "failed_to_start", time.time()
                self.finish("failed_to_start", f"could not start the command: {e}", 127)
                break
            self.say(f"attempt {attempt.index} ended: {describe(attempt)}")
            if attempt.last_step is not None:
                s.last_step = attempt.last_step
            if attempt.cause != "loss_spike":
                self.spikes.settle_replay(attempt)
            stop = self.stop_reason(attempt)
            if stop:
                self.finish(*stop)
                break
            if self.log_is_full():  # no restart on a full disk: it would fill again
                break
            if attempt.cause == "loss_spike":
                # Roll back and replay, or skip the data: bounded by --max_spike_events, not --max_restarts.
                stop = self.spikes.on_spike(attempt)
                if stop:
                    self.finish(*stop)
                    break
                attempt.counted, delay = False, 0.0  # a deterministic replay gains nothing by waiting
            else:
                # A crash or a hang: restart in resume mode, unless the budget is spent.
                stalled_in_a_row = 0 if attempt.made_progress else stalled_in_a_row + 1
                attempt.counted = not (self.cfg.count_only_stalled_restarts and attempt.made_progress)
                if attempt.counted and s.counted_restarts >= self.cfg.max_restarts:
                    self.finish("gave_up", f"{attempt.cause} after {s.counted_restarts} counted restarts "
                                f"(--max_restarts={self.cfg.max_restarts})", exit_code_of(attempt))
                    break
                delay = backoff_delay(self.cfg.backoff_base, self.cfg.backoff_max, stalled_in_a_row)
            command, how = self.restart_command()
            self.say(f"restarting in {delay:g}s with {how}")
            if not self.sleep_unless_stopped(delay):
                self.finish("stopped", "stop signal during the restart backoff", EXIT_INTERRUPTED)
                break
            resume_step = newest_checkpoint_step(self.cfg.out_dir)
            if attempt.last_step is not None:
                attempt.steps_lost = max(0, attempt.last_step - resume_step)
            s.restarts += 1
            s.counted_restarts += int(attempt.counted)
        s.total_steps_lost = sum(a.steps_lost for a in s.attempts)
        s.total_time_s = round(time.time() - t0, 3)
        self.report()
        return s.exit_code

    def stop_reason(self, a: Attempt) -> Optional[tuple[str, str, int]]:
        """(status, reason, exit code) when this attempt ends the run; None to restart."""
        if a.cause == "stopped":
            # The trainer saved and exited 75; torchrun's agent reports 1 even when its workers
            # did. A tree we had to SIGKILL (second signal) did not save.
            code = a.exit_code if a.exit_code in (EXIT_OK, EXIT_INTERRUPTED) else (
                exit_code_of(a) if self.child and self.child.killed_by_monitor else EXIT_INTERRUPTED)
            return "stopped", f"stopped by {signal.Signals(self.stop_signal).name} to the monitor", code
        if a.cause == "completed":
            return "completed", "the training exited 0", EXIT_OK
        if a.cause == "non_retryable":
            code = a.root_exit_code if a.root_exit_code is not None else a.exit_code
            return ("non_retryable", f"exit code {code} is not retryable "
                    "(2 config, 3 data, 4 non-finite loss, 5 checkpoint, 6 run directory in use, 7 disk full)", code)
        if a.cause == "interrupted":
            return ("interrupted", "the training stopped and saved (exit 75: a stop signal from someone else, or its "
                    "--exit_duration_in_mins); not restarting over an operator's decision", EXIT_INTERRUPTED)
        return None

    def restart_command(self) -> tuple[list[str], str]:
        """(the command of the next attempt, how it was made, for the log)."""
        return restart_command(self.command, self.cfg.out_dir, self.spikes.skip_steps)


    def announce_stop(self) -> None:
        if not self.stop_announced:
            self.stop_announced = True
            self.say(f"received {signal.Signals(self.stop_signal).name}: forwarded to the training's "
                     f"process group; waiting for it to save and exit; no restart")

    def sleep_unless_stopped(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stop_signal is not None:
                return False
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
        return self.stop_signal is None

    def log_is_full(self) -> bool:
        """Whether the log stopped on a full disk (RunLog); if so the run is finished with exit 7."""
        if self.log.failed is None:
            return False
        self.finish("disk_full", f"disk full: {self.log.failed}", EXIT_DISK_FULL)
        return True

    def finish(self, status: str, reason: str, code: int) -> None:
        self.summary.final_status, self.summary.reason, self.summary.exit_code = status, reason, code

    # -- the report -----------------------------------------------------------------------------
    def report(self) -> None:
        s = self.summary
        for line in report_lines(s):
            self.say(line)
        if self.cfg.summary_file:
            try:
                write_summary(s, self.cfg.summary_file)
            except DiskFullError as e:  # the record of the run did not fit: exit 7, whatever the run did
                s.exit_code = EXIT_DISK_FULL
                self.say(f"error: disk full: {e}; exit code {EXIT_DISK_FULL}")
        self.log.close()
