"""monitor_process.py on a full disk: its own writes (the log file, the tee threads' copy of the training's
output, the summary) that do not fit end the supervision with exit 7 and one line naming the file, never a
traceback, and nothing more is started on that disk (utils/disk_space.py). In this process, with the full disk
injected into the monitor's `open` / `atomic_write_text`; the child is a small python -c command."""
from __future__ import annotations

import builtins
import errno
import json
import os
import signal
import sys

import pytest

from monitor import process, record
from monitor.cli import main
from utils.constants import EXIT_DISK_FULL

FAST = ["--backoff_base=0.05", "--backoff_max=0.1", "--poll_interval=0.05", "--kill_grace=0.5", "--hang_timeout=0",
        "--max_restarts=2"]


@pytest.fixture(autouse=True)
def _signal_handlers():
    """Monitor.run installs SIGINT/SIGTERM handlers: put pytest's back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


class _FullFile:
    """A file whose write raises ENOSPC once `full(data)` says so (a disk that filled then)."""

    def __init__(self, f, full):
        self.f, self.full = f, full

    def write(self, data):
        if self.full(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def flush(self):
        self.f.flush()

    def close(self):
        self.f.close()


def _log_fills(monkeypatch, full) -> None:
    real = builtins.open

    def fake(path, mode="r", *a, **kw):
        f = real(path, mode, *a, **kw)
        return _FullFile(f, full) if os.path.basename(str(path)) == "monitor.log" else f
    monkeypatch.setattr(process, "open", fake, raising=False)


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if "error:" in line]


def test_a_full_disk_at_the_first_log_line_starts_nothing(tmp_path, monkeypatch, capfd):
    out, marker = tmp_path / "run", tmp_path / "started"
    _log_fills(monkeypatch, lambda data: True)
    code = main([*FAST, f"--out_dir={out}", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    err = capfd.readouterr().err
    assert code == EXIT_DISK_FULL, err
    assert not marker.exists()  # the training was never started on the full disk
    lines = _error_lines(err)
    assert len(lines) == 1 and f"disk full: writing {out / 'monitor.log'} did not fit" in lines[0], err
    s = json.loads((out / "monitor_summary.json").read_text())
    assert (s["final_status"], s["exit_code"], s["attempts"]) == ("disk_full", EXIT_DISK_FULL, [])


def test_a_log_that_fills_under_the_tee_is_not_restarted(tmp_path, monkeypatch, capfd):
    """The disk fills while the tee threads copy a crashing attempt's output into the log: the output still reaches
    the terminal, and the crash is not restarted on the full disk (exit 7, one line naming the log)."""
    out = tmp_path / "run"
    _log_fills(monkeypatch, lambda data: b"CHILD-OUTPUT" in data)
    code = main([*FAST, f"--out_dir={out}", "--", sys.executable, "-c",
                    "import sys; print('CHILD' + '-OUTPUT', flush=True); sys.exit(1)"])  # not in the command line
    cap = capfd.readouterr()
    assert code == EXIT_DISK_FULL, cap.err
    assert "CHILD-OUTPUT" in cap.out  # the terminal copy goes on
    log = (out / "monitor.log").read_text()  # full only from the tee's write of the attempt's output on
    assert "attempt 0: " in log and "CHILD-OUTPUT" not in log and "attempt 0 ended" not in log, log
    lines = _error_lines(cap.err)
    assert len(lines) == 1 and f"disk full: writing {out / 'monitor.log'} did not fit" in lines[0], cap.err
    s = json.loads((out / "monitor_summary.json").read_text())
    assert (s["final_status"], s["exit_code"], s["restarts"], len(s["attempts"])) == ("disk_full", 7, 0, 1)


def test_a_summary_that_does_not_fit_is_exit_7_naming_it(tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"

    def full(path, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(record, "atomic_write_text", full)
    code = main([*FAST, f"--out_dir={out}", "--", sys.executable, "-c", "pass"])
    err = capfd.readouterr().err
    assert code == EXIT_DISK_FULL, err
    lines = _error_lines(err)
    assert len(lines) == 1 and f"disk full: writing {out / 'monitor_summary.json'} did not fit" in lines[0], err
    assert "final status: completed" in err  # the training itself finished


def test_the_real_process_under_a_file_size_limit_stops_with_exit_7(tmp_path):
    """monitor_process.py as a process under RLIMIT_FSIZE (8 KiB, SIGXFSZ ignored: a write past it fails with EFBIG,
    as a full disk fails with ENOSPC): the tee's copy of a crashing attempt's 30 KB of output does not fit in
    monitor.log. One error line naming the file, no traceback, exit 7, no restart."""
    import resource
    import subprocess

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 10, 8 << 10))
    out = tmp_path / "run"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, os.path.join(root, "monitor_process.py"), *FAST, f"--out_dir={out}", "--",
                        sys.executable, "-c", "import sys; [print('y' * 100) for _ in range(300)]; sys.exit(1)"],
                       capture_output=True, text=True, preexec_fn=limit, timeout=120)
    assert p.returncode == EXIT_DISK_FULL, p.stderr[-3000:]
    lines = _error_lines(p.stderr)
    assert len(lines) == 1 and f"disk full: writing {out / 'monitor.log'} did not fit" in lines[0], p.stderr
    s = json.loads((out / "monitor_summary.json").read_text())
    assert (s["final_status"], s["restarts"], len(s["attempts"])) == ("disk_full", 0, 1)
