"""The processes the supervisor starts and the file it logs to: one attempt's process tree (its own session, output
teed to the terminal and the log, every process group it spawned remembered so that the whole tree can be killed,
torchrun workers in their own sessions too) and `RunLog`. Signals only the groups of the trees it started."""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time
from typing import BinaryIO, Optional

from utils.disk_space import DiskFullError, writing
from utils.proc_tree import descendant_groups

TAIL_BYTES = 64 * 1024  # enough of the output to find torchrun's "Root Cause" block


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

