"""Supervisor for unattended training runs: start, watch, restart, report.

    python monitor_process.py [options] -- <training command ...>

What it owns:
- Starting the training command (an argument list, never a string split on spaces) in its own
  process group, teeing its stdout/stderr to the terminal and to a log file.
- Deciding what an exit means (utils/constants.py): 0 is done and is NEVER restarted; 2/3/4/5/6 are
  non-retryable and are reported; 75 means the run was interrupted after saving; 76 is a loss spike
  (--spike_guard, below); anything else, including death by a signal, is a crash that is restarted
  after an exponential backoff, up to --max_restarts, with the original command: the trainer continues
  the run in its out_dir by itself (`--resume=auto`, its default). Only a command that says
  `--resume=never` is changed, to `--resume=always`, once the run recorded its start (run_start.json or
  a checkpoint); before that it too is restarted unchanged.
- Loss spikes (exit 76, the step in <out_dir>/spike.json): move the checkpoints at or after the spike
  aside, replay from the newest one before it; a spike that comes back at the same step is the data's
  fault and its data window is skipped (`--skip_data_steps=` on every later restart), one that does
  not is the machine's and is only logged.
- Hang detection from the mtime of <out_dir>/heartbeat and <out_dir>/metrics.jsonl, killing the
  whole process tree it started (all ranks, also torchrun workers that live in their own sessions).
- Forwarding SIGINT/SIGTERM to the training's process group and then stopping without a restart.
- A summary (stdout and <out_dir>/monitor_summary.json): restarts, causes, steps lost, final status.
- A full disk (or quota, or a file-size limit) under its own writes: the log file (`RunLog`) or the summary
  that does not fit ends the supervision with exit 7 and one line naming the file (utils/disk_space.py), and
  nothing more is started on it: not the first attempt, not a restart.

What it must never do:
- Restart a run that exited 0 or with a non-retryable code (trap 15), or split the command on
  spaces (trap 16).
- Import torch or anything of the training stack: it must keep working when those are broken.
- Write anything in out_dir besides its log, summary and run.lock (it holds the run directory's lock for
  the whole supervision, utils/run_lock.py; its attempts continue under it); checkpoints belong to the trainer. The one
  exception: after a loss spike it MOVES checkpoints it must not resume into checkpoints_after_spike/
  (never deletes them).
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
from utils.checkpoint_layout import COMPLETE_MARKER, RUN_START, checkpoint_root, parse_step
from utils.run_dir import misnamed_step
from utils.constants import EXIT_DISK_FULL, EXIT_INTERRUPTED, EXIT_LOSS_SPIKE, EXIT_OK, NON_RETRYABLE_EXIT_CODES
from utils.disk_space import DiskFullError, writing
from utils import run_lock
from utils.proc_tree import descendant_groups
from utils.publish import atomic_write_text
from utils.run_lock import TOKEN_ENV
from utils.spike_guard import AFTER_SPIKE_DIR, SPIKE_FILE, format_data_steps, parse_data_steps, read_spike_record

RESUME_FLAG = "--resume"      # the trainer's: auto (default) | always | never
RESUME_VALUE = "always"
SKIP_FLAG = "--skip_data_steps"
SPIKE_SKIP_CHOICES = ("since_checkpoint", "step")
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
    spike_skip: str = "since_checkpoint"
    max_spike_events: int = 10


def parse_args(argv: list[str]) -> tuple[MonitorConfig, list[str]]:
    """Split argv at the first `--`: monitor options before it, the command (kept verbatim) after."""
    from utils.cli import DefaultsHelpFormatter
    p = argparse.ArgumentParser(
        prog="monitor_process.py", usage="%(prog)s [options] -- <training command ...>",
        formatter_class=DefaultsHelpFormatter,
        epilog="example: python monitor_process.py --max_restarts=20 --hang_timeout=900 -- "
               "torchrun --standalone --nproc_per_node=8 train_my_ddp.py --out_dir=out/pre ...",
        description="Run a training command, restart it on crashes and hangs, report what happened. "
                    "Exit 0 and exit codes 2 (bad config), 3 (bad data), 4 (non-finite loss), "
                    "5 (unusable checkpoint) are never restarted; 75 (interrupted after saving) stops the monitor too; "
                    "76 (a loss spike, train_my_ddp.py --spike_guard=true) rolls back to the checkpoint before it, "
                    "replays once, and skips the data if the spike comes back (docs/monitor.md).")
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
    p.add_argument("--spike_skip", choices=SPIKE_SKIP_CHOICES, default="since_checkpoint",
                   help="data skipped after a loss spike that reproduced: since_checkpoint (default: every data "
                        "step from the checkpoint the replay resumed from up to the spike, as PaLM did) or step "
                        "(only the spike step's data)")
    p.add_argument("--max_spike_events", type=int, default=10,
                   help="loss spikes handled (rollback + replay) before giving up; these restarts do not count "
                        "against --max_restarts")
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
                        a.kill_grace, a.poll_interval, a.spike_skip, a.max_spike_events)
    return cfg, command


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

class RunLog:
    """The monitor's log file (--log_file; os.devnull without one): its own lines and the attempts' output,
    appended and flushed under one lock. A write that does not fit (disk or quota full, a file-size limit:
    utils/disk_space.py) ends the log there: `failed` keeps the DiskFullError naming the file, stderr gets its
    line once, and later writes are dropped, so the tee threads go on copying the output to the terminal (a
    tee thread that died would leave the training blocked on a full pipe)."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path or os.devnull
        self.failed: Optional[DiskFullError] = None
        self.lock = threading.Lock()
        with writing(self.path):  # DiskFullError naming the file (not even its inode fits)
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f: BinaryIO = open(self.path, "ab")

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.failed is not None:
                return
            try:
                with writing(self.path):
                    self._f.write(data)
                    self._f.flush()
            except DiskFullError as e:
                self.failed = e
                try:
                    sys.stderr.write(f"monitor_process.py: error: disk full: {e}\n")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass

    def close(self) -> None:
        with self.lock:
            try:
                self._f.close()
            except OSError:  # the rest of a buffer that did not fit either
                pass


class Child:
    """One attempt's process: Popen in a new session, output tee threads, the groups it spawned."""

    def __init__(self, command: list[str], log: RunLog, env: Optional[dict] = None, pass_fds: tuple = ()) -> None:
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True, env=env, pass_fds=pass_fds)
        self.pgid = self.proc.pid  # session leader == group leader
        self.groups: set[int] = {self.pgid}
        self.killed_by_monitor = False
        self.stop_forwarded = False
        self._tail: collections.deque[bytes] = collections.deque()
        self._tail_len = 0
        self._tail_lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._tee, args=(self.proc.stdout, sys.stdout, log), daemon=True),
            threading.Thread(target=self._tee, args=(self.proc.stderr, sys.stderr, log), daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _tee(self, pipe: BinaryIO, terminal, log: RunLog) -> None:
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
            log.write(chunk)  # a full disk stops the log, not this copy (RunLog)
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
    # loss spikes (exit 76): {"skip_policy", "skip_data_steps", "events": [{"step", "data_step", "loss",
    # "median", "reason", "attempt", "rolled_back_to_step", "moved_aside", "reproduced", "verdict", ...}]}
    spike_guard: dict = field(default_factory=dict)


class Monitor:
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
        try:  # data steps the command already skips; spikes that reproduce add to them
            self.skip_steps: set[int] = set(parse_data_steps(flag_value(command, SKIP_FLAG) or ""))
        except ValueError:
            self.skip_steps = set()  # the trainer names the bad value itself (exit 2)
        self.pending_spike: Optional[dict] = None  # the event being replayed
        self.summary.spike_guard = {"skip_policy": cfg.spike_skip, "skip_data_steps": sorted(self.skip_steps),
                                    "events": []}
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
        alive_at_start = liveness_mtime(cfg.out_dir)
        self.say(f"attempt {attempt.index}: {subprocess.list2cmdline(attempt.command)}")
        self.child = child = Child(attempt.command, self.log, env=self.child_env, pass_fds=self.pass_fds)
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
            attempt.cause = hang_cause or self.classify(attempt)

    def classify(self, a: Attempt) -> str:
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
            self.say(f"attempt {attempt.index} ended: {self.describe(attempt)}")
            if attempt.last_step is not None:
                s.last_step = attempt.last_step
            if attempt.cause != "loss_spike":
                self.settle_replay(attempt)
            stop = self.stop_reason(attempt)
            if stop:
                self.finish(*stop)
                break
            if self.log_is_full():  # no restart on a full disk: it would fill again
                break
            if attempt.cause == "loss_spike":
                # Roll back and replay, or skip the data: bounded by --max_spike_events, not --max_restarts.
                stop = self.on_spike(attempt)
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
                                f"(--max_restarts={self.cfg.max_restarts})", self.exit_code_of(attempt))
                    break
                delay = min(self.cfg.backoff_max, self.cfg.backoff_base * 2 ** max(0, stalled_in_a_row - 1))
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
                self.exit_code_of(a) if self.child and self.child.killed_by_monitor else EXIT_INTERRUPTED)
            return "stopped", f"stopped by {signal.Signals(self.stop_signal).name} to the monitor", code
        if a.cause == "completed":
            return "completed", "the training exited 0", EXIT_OK
        if a.cause == "non_retryable":
            code = a.root_exit_code if a.root_exit_code is not None else a.exit_code
            return ("non_retryable", f"exit code {code} is not retryable "
                    "(2 config, 3 data, 4 non-finite loss, 5 checkpoint, 6 run directory in use, 7 disk full)", code)
        if a.cause == "interrupted":
            return ("interrupted", "the training was interrupted by someone else and saved (exit 75); "
                    "not restarting over an operator's decision", EXIT_INTERRUPTED)
        return None

    def restart_command(self) -> tuple[list[str], str]:
        """(the command of the next attempt, how it was made, for the log)."""
        command = with_resume(self.command)
        if command == self.command:
            how = "the original command, unchanged (the trainer continues the run in its out_dir by itself)"
        elif self.cfg.out_dir and not run_has_started(self.cfg.out_dir):
            # --resume=never, and it died in start-up before the trainer recorded how the run starts:
            # --resume=always would find nothing (exit 2). Start it again the way the user did.
            command = list(self.command)
            how = (f"the original command, unchanged (no {RUN_START} and no checkpoint in the out_dir: the run "
                   "stopped before it recorded how it started)")
        else:
            how = f"{RESUME_FLAG}={RESUME_VALUE} in place of the command's {RESUME_FLAG}=never"
        if self.skip_steps:
            value = format_data_steps(self.skip_steps)
            command = with_flag(command, SKIP_FLAG, value)
            how += f" and {SKIP_FLAG}={value}"
        return command, f"{how}: {subprocess.list2cmdline(command)}"

    # -- loss spikes ----------------------------------------------------------------------------
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
        g, out_dir = self.summary.spike_guard, self.cfg.out_dir
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
        for line in lines:
            self.say(line)
        if self.cfg.summary_file:
            data = asdict(s)
            for a in data["attempts"]:
                a["started_at"], a["ended_at"] = round(a["started_at"], 3), round(a["ended_at"], 3)
            try:  # readers never see half a summary (`<summary_file>.tmp`, fsync, os.replace)
                with writing(self.cfg.summary_file):
                    atomic_write_text(self.cfg.summary_file, json.dumps(data, indent=2))
            except DiskFullError as e:  # the record of the run did not fit: exit 7, whatever the run did
                s.exit_code = EXIT_DISK_FULL
                self.say(f"error: disk full: {e}; exit code {EXIT_DISK_FULL}")
        self.log.close()


def main(argv: Optional[list[str]] = None) -> int:
    cfg, command = parse_args(sys.argv[1:] if argv is None else argv)
    lock = None
    if cfg.out_dir:  # one run per directory: a second supervisor (or a trainer already there) is refused
        try:
            lock = run_lock.acquire(cfg.out_dir, command="monitor_process.py -- " + subprocess.list2cmdline(command))
        except run_lock.REFUSALS as e:
            full = "disk full: " if isinstance(e, DiskFullError) else ""
            print(f"monitor_process.py: error: {full}{e}", file=sys.stderr, flush=True)
            return e.exit_code
    try:
        monitor = Monitor(cfg, command, lock_token=lock.token if lock else None, lock_fd=lock.fd if lock else None)
    except DiskFullError as e:  # not even the log file fits
        print(f"monitor_process.py: error: disk full: {e}", file=sys.stderr, flush=True)
        if lock is not None:
            lock.release()
        return EXIT_DISK_FULL
    try:
        return monitor.run()
    finally:
        if lock is not None:
            lock.release()


if __name__ == "__main__":
    sys.exit(main())
