"""Supervisor for unattended training runs: start, watch, restart, report.

    python monitor_process.py [options] -- <training command ...>

What it owns:
- Starting the training command (an argument list, never a string split on spaces) in its own
  process group, teeing its stdout/stderr to the terminal and to a log file.
- Deciding what an exit means (utils/constants.py): 0 is done and is NEVER restarted; 2/3/4/5 are
  non-retryable and are reported; 75 means the run was interrupted after saving; anything else,
  including death by a signal, is a crash that is restarted with `--init_from=resume` after an
  exponential backoff, up to --max_restarts.
- Hang detection from the mtime of <out_dir>/heartbeat and <out_dir>/metrics.jsonl, killing the
  whole process tree it started (all ranks, also torchrun workers that live in their own sessions).
- Forwarding SIGINT/SIGTERM to the training's process group and then stopping without a restart.
- A summary (stdout and <out_dir>/monitor_summary.json): restarts, causes, steps lost, final status.

What it must never do:
- Restart a run that exited 0 or with a non-retryable code (trap 15), or split the command on
  spaces (trap 16).
- Import torch or anything of the training stack: it must keep working when those are broken.
- Write anything in out_dir besides its log and summary; checkpoints belong to the trainer.
- Signal processes it did not start.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import BinaryIO, Optional

# The monitor lives next to utils/, so this import works from any working directory when the
# script is run by path (sys.path[0] is the script's directory).
from utils.constants import EXIT_INTERRUPTED, EXIT_OK, NON_RETRYABLE_EXIT_CODES

RESUME_FLAG = "--init_from"
RESUME_VALUE = "resume"
TAIL_BYTES = 64 * 1024  # enough of the output to find torchrun's "Root Cause" block


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

@dataclass
class MonitorConfig:
    out_dir: Optional[str]
    log_file: Optional[str]
    summary_file: Optional[str]
    max_restarts: int
    count_only_stalled_restarts: bool
    backoff_base: float
    backoff_max: float
    hang_timeout: float
    startup_timeout: float
    kill_grace: float
    poll_interval: float


def parse_args(argv: list[str]) -> tuple[MonitorConfig, list[str]]:
    """Split argv at the first `--`: monitor options before it, the command (kept verbatim) after."""
    p = argparse.ArgumentParser(
        prog="monitor_process.py", usage="%(prog)s [options] -- <training command ...>",
        epilog="example: python monitor_process.py --max_restarts=20 --hang_timeout=900 -- "
               "torchrun --standalone --nproc_per_node=8 train_my_ddp.py --out_dir=out/pre ...",
        description="Run a training command, restart it on crashes and hangs, report what happened. "
                    "Exit 0 and exit codes 2 (bad config), 3 (bad data), 4 (non-finite loss), "
                    "5 (unusable checkpoint) are never restarted; 75 (interrupted after saving) stops the monitor too.")
    p.add_argument("--out_dir", help="the run's out_dir (default: the command's --out_dir=)")
    p.add_argument("--log_file", help="tee file for the output (default: <out_dir>/monitor.log)")
    p.add_argument("--summary_file", help="default: <out_dir>/monitor_summary.json")
    p.add_argument("--max_restarts", type=int, default=10)
    p.add_argument("--count_only_stalled_restarts", action="store_true",
                   help="count a restart against --max_restarts only if the attempt before it made no "
                        "progress (no new step in metrics.jsonl, no newer checkpoint)")
    p.add_argument("--backoff_base", type=float, default=5.0, help="seconds before the first restart")
    p.add_argument("--backoff_max", type=float, default=300.0, help="cap of the doubling backoff")
    p.add_argument("--hang_timeout", type=float, default=600.0,
                   help="seconds without a heartbeat/metrics update before the run is killed (0: off)")
    p.add_argument("--startup_timeout", type=float, default=1800.0,
                   help="grace before the first heartbeat of each attempt (imports, data, compile)")
    p.add_argument("--kill_grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--poll_interval", type=float, default=1.0)
    if "--" not in argv:
        if any(x in ("-h", "--help") for x in argv):
            p.parse_args(["--help"])  # prints the help and exits 0
        p.error("the training command must follow `--` (see --help)")
    cut = argv.index("--")
    own, command = argv[:cut], argv[cut + 1:]
    a = p.parse_args(own)
    if not command:
        p.error("no training command after `--`")
    out_dir = a.out_dir or flag_value(command, "--out_dir") or flag_value(command, "--output_dir")
    log_file = a.log_file or (os.path.join(out_dir, "monitor.log") if out_dir else None)
    summary = a.summary_file or (os.path.join(out_dir, "monitor_summary.json") if out_dir else None)
    cfg = MonitorConfig(out_dir, log_file, summary, a.max_restarts, a.count_only_stalled_restarts,
                        a.backoff_base, a.backoff_max, a.hang_timeout, a.startup_timeout,
                        a.kill_grace, a.poll_interval)
    return cfg, command


def flag_value(command: list[str], key: str) -> Optional[str]:
    """Value of `key=v` or `key v` in the command; the last one wins, as in configurator.py."""
    value = None
    for i, arg in enumerate(command):
        if arg.startswith(key + "="):
            value = arg[len(key) + 1:]
        elif arg == key and i + 1 < len(command):
            value = command[i + 1]
    return value


def with_resume(command: list[str]) -> list[str]:
    """The command with every --init_from replaced by --init_from=resume (appended if absent).

    Appending at the end is right under torchrun too: everything after the script goes to it.
    """
    out: list[str] = []
    found = False
    skip_next = False
    for i, arg in enumerate(command):
        if skip_next:
            skip_next = False
            continue
        if arg.startswith(RESUME_FLAG + "="):
            out.append(f"{RESUME_FLAG}={RESUME_VALUE}")
            found = True
        elif arg == RESUME_FLAG and i + 1 < len(command):
            out.append(f"{RESUME_FLAG}={RESUME_VALUE}")
            found = skip_next = True
        else:
            out.append(arg)
    if not found:
        out.append(f"{RESUME_FLAG}={RESUME_VALUE}")
    return out


# ---------------------------------------------------------------------------------------------
# Reading the run's progress (files written by the trainer; read-only here)
# ---------------------------------------------------------------------------------------------

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


def newest_checkpoint_step(out_dir: Optional[str]) -> int:
    """Step of the newest checkpoints/step_XXXXXXXX/ holding COMPLETE — what a resume loads (0: none)."""
    if not out_dir:
        return 0
    root = os.path.join(out_dir, "checkpoints")
    best = 0
    try:
        names = os.listdir(root)
    except OSError:
        return 0
    for name in names:
        m = re.fullmatch(r"step_(\d+)", name)
        if m and os.path.exists(os.path.join(root, name, "COMPLETE")):
            best = max(best, int(m.group(1)))
    return best


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


def torchrun_root_cause_exit_code(output_tail: str) -> Optional[int]:
    """torchrun exits 1 whatever its workers returned; its report names the first failure's code."""
    if "ChildFailedError" not in output_tail:
        return None
    block = output_tail.rsplit("Root Cause", 1)[-1]
    m = re.search(r"exitcode\s*:\s*(-?\d+)", block)
    return int(m.group(1)) if m else None


# ---------------------------------------------------------------------------------------------
# The process tree we started
# ---------------------------------------------------------------------------------------------

def _process_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgid) from /proc (Linux). Empty where /proc is unavailable."""
    table: dict[int, tuple[int, int]] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return table
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may itself contain spaces or parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        table[pid] = (int(fields[1]), int(fields[2]))
    return table


def descendant_groups(root_pid: int) -> set[int]:
    """Process groups of root_pid's descendants. torchrun starts each worker in its own session,
    so killing torchrun's group alone would orphan hung workers."""
    table = _process_table()
    children: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)
    groups, stack = set(), [root_pid]
    while stack:
        pid = stack.pop()
        for child in children.get(pid, []):
            groups.add(table[child][1])
            stack.append(child)
    return groups


class Child:
    """One attempt's process: Popen in a new session, output tee threads, the groups it spawned."""

    def __init__(self, command: list[str], log: BinaryIO, log_lock: threading.Lock) -> None:
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True)
        self.pgid = self.proc.pid  # session leader == group leader
        self.groups: set[int] = {self.pgid}
        self.killed_by_monitor = False
        self.stop_forwarded = False
        self._tail: collections.deque[bytes] = collections.deque()
        self._tail_len = 0
        self._tail_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._tee, args=(self.proc.stdout, sys.stdout, log, log_lock), daemon=True),
            threading.Thread(target=self._tee, args=(self.proc.stderr, sys.stderr, log, log_lock), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _tee(self, pipe: BinaryIO, terminal, log: BinaryIO, log_lock: threading.Lock) -> None:
        # Chunks, not lines: progress bars use \r and a line may never end before a hang.
        while True:
            chunk = pipe.read1(65536)
            if not chunk:
                return
            try:
                getattr(terminal, "buffer", terminal).write(chunk)
                terminal.flush()
            except (OSError, ValueError):
                pass  # a closed terminal must not stop the log
            with log_lock:
                log.write(chunk)
                log.flush()
            with self._tail_lock:
                self._tail.append(chunk)
                self._tail_len += len(chunk)
                while self._tail_len > TAIL_BYTES and len(self._tail) > 1:
                    self._tail_len -= len(self._tail.popleft())

    def output_tail(self) -> str:
        with self._tail_lock:
            return b"".join(self._tail).decode("utf-8", "replace")

    def track_descendants(self) -> None:
        """Remember every group the tree has used, while the parents are still alive to tell us."""
        if self.proc.poll() is None:
            self.groups |= descendant_groups(self.proc.pid)

    def forward(self, sig: int) -> None:
        """Pass a stop signal on to the leader's group only: the trainer (or torchrun's agent,
        which relays it to its workers) saves and exits by itself."""
        self.stop_forwarded = True
        self.signal_groups(sig, leader_only=True)

    def signal_groups(self, sig: int, leader_only: bool = False) -> None:
        for pgid in ([self.pgid] if leader_only else sorted(self.groups)):
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def kill_tree(self, grace: float, poll: float) -> None:
        """SIGTERM every group of the tree, SIGKILL after `grace` seconds (a hung collective
        never returns to the Python signal handler)."""
        self.killed_by_monitor = True
        self.track_descendants()
        self.signal_groups(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.track_descendants()
            time.sleep(min(poll, 0.1))
        self.signal_groups(signal.SIGKILL)

    def reap(self) -> int:
        """Wait for the leader, kill leftovers of the tree (orphans would hold ports and pipes)."""
        rc = self.proc.wait()
        self.signal_groups(signal.SIGKILL)
        for t in self._threads:
            t.join(timeout=5)
        return rc


# ---------------------------------------------------------------------------------------------
# The supervision loop
# ---------------------------------------------------------------------------------------------

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


class Monitor:
    def __init__(self, cfg: MonitorConfig, command: list[str]) -> None:
        self.cfg = cfg
        self.command = command
        self.summary = Summary(command=command, out_dir=cfg.out_dir)
        self.stop_signal: Optional[int] = None
        self.stop_requests = 0
        self.stop_announced = False
        self.child: Optional[Child] = None
        self.metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl") if cfg.out_dir else None
        self.log_lock = threading.Lock()
        if cfg.log_file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.log_file)), exist_ok=True)
            self.log: BinaryIO = open(cfg.log_file, "ab")
        else:
            self.log = open(os.devnull, "wb")

    # -- messages -------------------------------------------------------------------------------
    def say(self, msg: str) -> None:
        line = f"[monitor {time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}\n"
        sys.stderr.write(line)
        sys.stderr.flush()
        with self.log_lock:
            self.log.write(line.encode())
            self.log.flush()

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
        best_step_before = max(steps_before, default=0)
        ckpt_before = newest_checkpoint_step(cfg.out_dir)
        alive_at_start = liveness_mtime(cfg.out_dir)
        self.say(f"attempt {attempt.index}: {subprocess.list2cmdline(attempt.command)}")
        self.child = child = Child(attempt.command, self.log, self.log_lock)
        hang_cause = ""
        start = time.time()
        while child.proc.poll() is None:
            child.track_descendants()
            if self.stop_signal is not None:
                if not child.stop_forwarded:  # the signal came before the child existed
                    child.forward(self.stop_signal)
                self.announce_stop()
            if not hang_cause and cfg.hang_timeout > 0 and cfg.out_dir:
                now = time.time()
                alive = liveness_mtime(cfg.out_dir)
                if alive is None or alive == alive_at_start:
                    if now - start > cfg.startup_timeout:
                        hang_cause = "startup_timeout"
                        self.say(f"no heartbeat {now - start:.0f}s after start (startup_timeout "
                                 f"{cfg.startup_timeout:g}s): killing the process tree")
                elif now - alive > cfg.hang_timeout:
                    hang_cause = "hang"
                    self.say(f"no heartbeat for {now - alive:.0f}s (hang_timeout {cfg.hang_timeout:g}s): "
                             f"killing the process tree")
                if hang_cause:
                    child.kill_tree(cfg.kill_grace, cfg.poll_interval)
            time.sleep(cfg.poll_interval)
        rc = child.reap()
        attempt.ended_at = time.time()
        attempt.exit_code = rc if rc >= 0 else None
        attempt.signal = signal.Signals(-rc).name if rc < 0 else None
        attempt.root_exit_code = torchrun_root_cause_exit_code(child.output_tail()) if rc == 1 else None
        if self.metrics_path:
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
            attempt.cause = hang_cause or self.classify(attempt)

    def classify(self, a: Attempt) -> str:
        code = a.root_exit_code if a.root_exit_code is not None else a.exit_code
        if a.exit_code == EXIT_OK:
            return "completed"
        if code in NON_RETRYABLE_EXIT_CODES:
            return "non_retryable"
        if code == EXIT_INTERRUPTED:
            return "interrupted"
        return "signal" if a.signal else "crash"

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
            attempt = Attempt(index=len(s.attempts), command=command, started_at=time.time(),
                              resumed_from_step=newest_checkpoint_step(self.cfg.out_dir) if s.attempts else 0)
            s.attempts.append(attempt)
            try:
                self.run_attempt(attempt)
            except OSError as e:  # the executable is missing or not runnable: retrying cannot help
                attempt.cause, attempt.ended_at = "failed_to_start", time.time()
                self.finish("failed_to_start", f"could not start the command: {e}", 127)
                break
            self.say(f"attempt {attempt.index} ended: {self.describe(attempt)}")
            if attempt.last_step is not None:
                s.last_step = attempt.last_step
            stop = self.stop_reason(attempt)
            if stop:
                self.finish(*stop)
                break
            # A crash or a hang: restart in resume mode, unless the budget is spent.
            stalled_in_a_row = 0 if attempt.made_progress else stalled_in_a_row + 1
            attempt.counted = not (self.cfg.count_only_stalled_restarts and attempt.made_progress)
            if attempt.counted and s.counted_restarts >= self.cfg.max_restarts:
                self.finish("gave_up", f"{attempt.cause} after {s.counted_restarts} counted restarts "
                            f"(--max_restarts={self.cfg.max_restarts})", self.exit_code_of(attempt))
                break
            delay = min(self.cfg.backoff_max, self.cfg.backoff_base * 2 ** max(0, stalled_in_a_row - 1))
            self.say(f"restarting in {delay:g}s with {RESUME_FLAG}={RESUME_VALUE}")
            if not self.sleep_unless_stopped(delay):
                self.finish("stopped", "stop signal during the restart backoff", EXIT_INTERRUPTED)
                break
            resume_step = newest_checkpoint_step(self.cfg.out_dir)
            if attempt.last_step is not None:
                attempt.steps_lost = max(0, attempt.last_step - resume_step)
            s.restarts += 1
            s.counted_restarts += int(attempt.counted)
            command = with_resume(self.command)
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
                self.exit_code_of(a) if self.child and self.child.killed_by_monitor else EXIT_INTERRUPTED)
            return "stopped", f"stopped by {signal.Signals(self.stop_signal).name} to the monitor", code
        if a.cause == "completed":
            return "completed", "the training exited 0", EXIT_OK
        if a.cause == "non_retryable":
            code = a.root_exit_code if a.root_exit_code is not None else a.exit_code
            return ("non_retryable", f"exit code {code} is not retryable "
                    "(2 config, 3 data, 4 non-finite loss, 5 checkpoint)", code)
        if a.cause == "interrupted":
            return ("interrupted", "the training was interrupted by someone else and saved (exit 75); "
                    "not restarting over an operator's decision", EXIT_INTERRUPTED)
        return None

    @staticmethod
    def exit_code_of(a: Attempt) -> int:
        if a.exit_code:
            return a.exit_code
        if a.signal:
            return 128 + signal.Signals[a.signal].value
        return 1

    @staticmethod
    def describe(a: Attempt) -> str:
        how = f"signal {a.signal}" if a.signal else f"exit code {a.exit_code}"
        if a.root_exit_code is not None:
            how += f" (torchrun worker exit code {a.root_exit_code})"
        return (f"{a.cause}, {how}, steps {a.first_step}..{a.last_step}, "
                f"{a.ended_at - a.started_at:.1f}s")

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

    def finish(self, status: str, reason: str, code: int) -> None:
        self.summary.final_status, self.summary.reason, self.summary.exit_code = status, reason, code

    # -- the report -----------------------------------------------------------------------------
    def report(self) -> None:
        s = self.summary
        lines = [f"final status: {s.final_status} ({s.reason}); exit code {s.exit_code}",
                 f"restarts: {s.restarts} ({s.counted_restarts} counted), steps lost: {s.total_steps_lost}, "
                 f"last step: {s.last_step}, total time: {s.total_time_s:.1f}s"]
        for a in s.attempts[:-1]:
            lines.append(f"  restart after attempt {a.index}: {a.cause} "
                         f"(exit {a.exit_code}, signal {a.signal}), last step {a.last_step}, "
                         f"steps lost {a.steps_lost}")
        for line in lines:
            self.say(line)
        if self.cfg.summary_file:
            data = asdict(s)
            for a in data["attempts"]:
                a["started_at"], a["ended_at"] = round(a["started_at"], 3), round(a["ended_at"], 3)
            tmp = self.cfg.summary_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(data, f, indent=2)
            os.replace(tmp, self.cfg.summary_file)  # readers never see half a summary
        self.log.close()


def main(argv: Optional[list[str]] = None) -> int:
    cfg, command = parse_args(sys.argv[1:] if argv is None else argv)
    return Monitor(cfg, command).run()


if __name__ == "__main__":
    sys.exit(main())
