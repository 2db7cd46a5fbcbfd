"""One run per run directory (utils/run_lock.py): a second trainer or supervisor on a held --out_dir is
refused with one line naming the holder (exit 6) and changes nothing there; a SIGKILLed holder leaves no
stale lock; the supervisor's attempts continue under its lock; an --out_dir that cannot be made is a flag
error (exit 2) answered before torch is imported."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import PY, ROOT, run_python, run_trainer, train_cmd
from utils import run_lock
from utils.constants import EXIT_BAD_CONFIG, EXIT_RUN_DIR_BUSY, NON_RETRYABLE_EXIT_CODES


def _tree_digest(root) -> dict:
    """Every file under root (the lock file aside: its record names the holder) -> sha256 and mtime."""
    out = {}
    for d, _, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            if name == run_lock.LOCK_NAME:
                continue
            with open(p, "rb") as f:
                out[os.path.relpath(p, root)] = (hashlib.sha256(f.read()).hexdigest(), os.stat(p).st_mtime_ns)
    return out


def test_second_holder_is_refused_with_the_first_ones_pid_and_host(tmp_path):
    out = tmp_path / "run"
    first = run_lock.acquire(str(out), command="train_my_ddp.py --out_dir=run")
    try:
        with pytest.raises(run_lock.RunDirBusy) as e:
            run_lock.acquire(str(out))  # another open file description: flock refuses it, even in one process
        msg = str(e.value)
        assert f"pid {os.getpid()} on {socket.gethostname()}" in msg and str(out) in msg, msg
        assert e.value.exit_code == EXIT_RUN_DIR_BUSY
    finally:
        first.release()
    run_lock.acquire(str(out)).release()  # released: free again
    assert EXIT_RUN_DIR_BUSY in NON_RETRYABLE_EXIT_CODES


def test_a_sigkilled_holder_leaves_no_stale_lock(tmp_path):
    out = tmp_path / "run"
    code = ("import sys, time; from utils import run_lock; run_lock.acquire(sys.argv[1]); "
            "print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(run_lock.RunDirBusy, match=f"pid {proc.pid} "):
            run_lock.acquire(str(out))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert os.path.exists(out / run_lock.LOCK_NAME)  # the file stays; the kernel dropped the lock with the process
    run_lock.acquire(str(out)).release()


def test_the_supervisors_token_lets_its_attempts_continue(tmp_path, monkeypatch):
    out = tmp_path / "run"
    held = run_lock.acquire(str(out), command="monitor_process.py -- ...")
    try:
        monkeypatch.setenv(run_lock.TOKEN_ENV, "0" * 32)  # somebody else's token: refused
        with pytest.raises(run_lock.RunDirBusy):
            run_lock.acquire(str(out))
        monkeypatch.setenv(run_lock.TOKEN_ENV, held.token)
        inner = run_lock.acquire(str(out))
        assert inner.inherited and inner.fd is None
        assert json.loads((out / run_lock.LOCK_NAME).read_text())["pid"] == os.getpid()  # the record is untouched
    finally:
        held.release()


@pytest.mark.parametrize("kind", ["file", "under_file"])
def test_an_out_dir_that_cannot_be_made_is_a_flag_error(tmp_path, kind):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker if kind == "file" else blocker / "run"
    with pytest.raises(run_lock.RunDirUnusable) as e:
        run_lock.acquire(str(out))
    assert e.value.exit_code == EXIT_BAD_CONFIG and str(out) in str(e.value)


def test_trainer_refuses_an_out_dir_another_run_holds_and_touches_nothing(tmp_path, tiny_pretrain_run_args):
    """The high-severity case of the reliability review: a second trainer started on a live run's directory
    'resumed' its run_start.json, moved its metrics aside and overwrote its checkpoints, exit 0. Here the
    directory holds a finished 3-step run; its files are held (as a live run holds them) while a second
    trainer starts there: exit 6, one line naming the holder, and not one byte of the run changes."""
    out = tmp_path / "run"
    args = [*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=3"]
    first = run_trainer(train_cmd(args), env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert first.returncode == 0, first.stderr[-2000:]
    before = _tree_digest(out)
    assert "metrics.jsonl" in before and any(k.startswith("checkpoints") for k in before)
    held = run_lock.acquire(str(out), command="train_my_ddp.py (the live run)")
    try:
        second = run_trainer(train_cmd([*args, "--max_iters=6"]), env=dict(os.environ, OMP_NUM_THREADS="1"))
        # the full start-up too, not only the pre-check: the process that forks ranks skips the pre-check
        direct = subprocess.run([PY, os.path.join(ROOT, "train_my_ddp.py"), *args, "--max_iters=6"], cwd=ROOT,
                                capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    finally:
        held.release()
    for proc in (second, direct):
        assert proc.returncode == EXIT_RUN_DIR_BUSY, proc.stderr[-2000:]
        lines = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"is in use by another run: pid {os.getpid()} on {socket.gethostname()}" in lines[0], lines[0]
    assert _tree_digest(out) == before


def test_a_second_supervisor_is_refused_before_it_starts_anything(tmp_path):
    out = tmp_path / "run"
    marker = tmp_path / "started"
    held = run_lock.acquire(str(out), command="monitor_process.py (the first)")
    try:
        proc = run_python([PY, "monitor_process.py", f"--out_dir={out}", "--",
                           PY, "-c", f"open({str(marker)!r}, 'w').write('x')"])
    finally:
        held.release()
    assert proc.returncode == EXIT_RUN_DIR_BUSY, proc.stderr
    assert "monitor_process.py: error: --out_dir=" in proc.stderr and "in use by another run" in proc.stderr
    assert not marker.exists() and not (out / "monitor.log").exists()


def test_supervised_attempts_run_under_the_supervisors_lock(tmp_path):
    """The command the supervisor starts finds the lock held by the supervisor and continues (it would be
    refused with exit 6 without the token), and a crash's restart does too."""
    out = tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from utils import run_lock\n"
        "lock = run_lock.acquire(sys.argv[1])\n"
        "n = os.path.join(sys.argv[1], 'attempts')\n"
        "k = len(open(n).read()) if os.path.exists(n) else 0\n"
        "open(n, 'a').write('x' if lock.inherited else 'o')\n"
        "sys.exit(1 if k == 0 else 0)\n")
    proc = run_python([PY, "monitor_process.py", f"--out_dir={out}", "--backoff_base=0", "--", PY, str(script),
                       str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "attempts").read_text() == "xx"
    run_lock.acquire(str(out)).release()  # the supervisor let go when it ended


@pytest.mark.parametrize("name,kind", [("heartbeat", "dir"), ("metrics.jsonl", "dir"), ("checkpoints", "file")])
def test_a_run_directory_with_the_wrong_kind_of_entry_is_one_line(tmp_path, tiny_pretrain_run_args, capsys, name, kind):
    """`heartbeat` or `metrics.jsonl` a directory, `checkpoints` a file (issue 33 item 14): exit 2 naming it, from
    the pre-check and the full start alike, before anything is written (it trained from scratch until the first
    save crashed, or died at the first heartbeat with a traceback)."""
    import train_my_ddp as T
    out = tmp_path / "run"
    out.mkdir()
    (out / name).mkdir() if kind == "dir" else (out / name).write_text("x")
    code = T.main([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_CONFIG and len(err) == 1, err
    assert f"{out / name} is a {'directory' if kind == 'dir' else 'file'}, where the run keeps" in err[0], err
    assert sorted(os.listdir(out)) == sorted([name, run_lock.LOCK_NAME])  # nothing else written
    run_lock.acquire(str(out)).release()  # the refused start let go of the lock
    pre = run_python([PY, "train_my_ddp.py", *tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=2"])
    assert pre.returncode == EXIT_BAD_CONFIG and "where the run keeps" in pre.stderr, pre.stderr
