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


def test_a_lock_record_that_does_not_fit_is_exit_7(tmp_path, monkeypatch):
    """A start (trainer or supervisor) on a full disk: writing run.lock is a full disk (exit 7, never retried),
    not a flag error (exit 2), and the lock is not left held."""
    import builtins
    import errno

    from utils.constants import EXIT_DISK_FULL
    from utils.disk_space import DiskFullError
    real = builtins.open

    def full(path, mode="r", *a, **kw):
        if "w" in mode and os.path.basename(str(path)).startswith(run_lock.LOCK_NAME):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, mode, *a, **kw)
    monkeypatch.setattr(run_lock, "open", full, raising=False)
    with pytest.raises(DiskFullError) as e:
        run_lock.acquire(str(tmp_path))
    assert e.value.exit_code == EXIT_DISK_FULL and isinstance(e.value, run_lock.REFUSALS)
    assert str(e.value).startswith(f"writing {run_lock.lock_path(str(tmp_path))} did not fit")
    monkeypatch.undo()
    run_lock.acquire(str(tmp_path)).release()  # nothing held


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


def test_deleting_run_lock_does_not_let_a_second_run_in(tmp_path):
    """The directory itself is locked: removing run.lock (its record) leaves the holder holding it."""
    out = tmp_path / "run"
    held = run_lock.acquire(str(out), command="the live run")
    try:
        os.remove(out / run_lock.LOCK_NAME)
        with pytest.raises(run_lock.RunDirBusy):
            run_lock.acquire(str(out))
    finally:
        held.release()
    run_lock.acquire(str(out)).release()


def test_the_supervisor_watch_fires_only_when_its_process_is_gone():
    clock = [0.0]
    me = run_lock.supervisor_env()
    assert run_lock.SupervisorWatch({}).gone() is None  # not supervised: never
    live = run_lock.SupervisorWatch(me, clock=lambda: clock[0])
    assert live.pid == os.getpid() and live.gone() is None
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # an exited process's pid
    dead = run_lock.SupervisorWatch(run_lock.supervisor_env(proc.pid), clock=lambda: clock[0])
    assert f"pid {proc.pid}" in (dead.gone() or "")
    if me[run_lock.SUPERVISOR_ENV].endswith(":"):
        pytest.skip("no /proc here: a reused pid cannot be told from its first process")
    reused = run_lock.SupervisorWatch({run_lock.SUPERVISOR_ENV: f"{os.getpid()}:1"}, clock=lambda: clock[0])
    assert "has exited" in (reused.gone() or "")  # alive, but not the process that started the run
    clock[0] = 0.5
    assert reused.gone() is None  # looked less than a period ago
    clock[0] = 1.5
    assert reused.gone() is not None


def test_a_sigkilled_supervisors_attempt_keeps_the_directory_then_stops(tmp_path):
    """SIGKILL of monitor_process.py: its attempt (alive, orphaned) still holds the directory, so a second run is
    refused (naming the dead supervisor), and the attempt notices the supervisor is gone, stops, and lets go."""
    out = tmp_path / "run"
    script = tmp_path / "child.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {ROOT!r})\n"
        "from utils import run_lock\n"
        "lock = run_lock.acquire(sys.argv[1])\n"
        "assert lock.inherited\n"
        "watch = run_lock.SupervisorWatch(period=0.05)\n"
        "open(os.path.join(sys.argv[1], 'started'), 'w').write(str(os.getpid()))\n"
        "deadline = time.time() + 60\n"
        "while time.time() < deadline and not watch.gone():\n"
        "    time.sleep(0.05)\n"
        "open(os.path.join(sys.argv[1], 'noticed'), 'w').write('x')\n"
        "while time.time() < deadline and not os.path.exists(os.path.join(sys.argv[1], 'go')):\n"
        "    time.sleep(0.05)  # still writing after it noticed: until the test has tried the directory\n"
        "open(os.path.join(sys.argv[1], 'stopped'), 'w').write('x')\n")
    mon = subprocess.Popen([PY, "monitor_process.py", f"--out_dir={out}", "--", PY, str(script), str(out)],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not ((out / "started").exists() and (out / "started").read_text()) and time.time() < deadline:
            time.sleep(0.05)  # the child creates the file, then writes its pid into it
        assert (out / "started").exists()
        child = int((out / "started").read_text())
        mon.kill()
        mon.wait()
        with pytest.raises(run_lock.RunDirBusy, match=rf"pid {mon.pid} .*has exited; a process it started"):
            run_lock.acquire(str(out))  # the orphan is still there: the directory is still its
        while not (out / "noticed").exists() and time.time() < deadline:
            time.sleep(0.05)
        assert (out / "noticed").exists(), "the attempt did not notice its supervisor was gone"
        (out / "go").write_text("x")  # (it waits for this: a busy machine cannot make the refusal above racy)
        while not (out / "stopped").exists() and time.time() < deadline:
            time.sleep(0.05)
        assert (out / "stopped").exists(), "the attempt did not notice its supervisor was gone"
        while time.time() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        run_lock.acquire(str(out)).release()  # it has exited: free
    finally:
        if mon.poll() is None:
            mon.kill()


def test_a_trainer_whose_supervisor_is_gone_saves_and_stops(tmp_path, tiny_pretrain_run_args, monkeypatch, capsys):
    """The trainer's side: a supervisor named in the environment that is not running (this pid with another start
    time: a reused pid) stops the run after its first step as SIGTERM would: saved, exit 75, said why."""
    import train_my_ddp as T
    from utils.constants import EXIT_INTERRUPTED
    if run_lock.supervisor_env()[run_lock.SUPERVISOR_ENV].endswith(":"):
        pytest.skip("no /proc here")
    monkeypatch.setenv(run_lock.SUPERVISOR_ENV, f"{os.getpid()}:1")
    out = tmp_path / "run"
    code = T.main([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=6"])
    text = capsys.readouterr()
    assert code == EXIT_INTERRUPTED, text.err[-2000:]
    assert "the supervisor (monitor_process.py" in text.out + text.err
    assert "stop requested by the supervisor's exit: saved step 1" in text.out + text.err
    assert sorted(os.listdir(out / "checkpoints")) == ["step_00000001"]


def test_a_checkpoint_copied_under_another_name_is_neither_loaded_nor_pruned(tmp_path, tiny_pretrain_run_args,
                                                                               capsys):
    """A copy of step 3 named step_99999999999999999999: the newest by name, but its trainer_state.json says 3.
    The resume loads the real step 3, pruning (--keep_last=1) keeps the copy, and the load line names why."""
    import shutil

    import train_my_ddp as T
    from checkpoint.verify import find_latest_valid
    out = tmp_path / "run"
    args = [*tiny_pretrain_run_args, f"--out_dir={out}", "--keep_last=1"]
    assert T.main([*args, "--max_iters=3"]) == 0
    root = out / "checkpoints"
    copy = root / "step_99999999999999999999"
    shutil.copytree(root / "step_00000003", copy)
    logged = []
    assert find_latest_valid(str(out), log=logged.append) == str(root / "step_00000003")
    assert any(str(copy) in m and "records step 3" in m for m in logged), logged
    capsys.readouterr()
    assert T.main([*args, "--max_iters=6", "--resume=auto"]) == 0
    text = capsys.readouterr()
    assert "step_00000003" in text.out + text.err
    assert sorted(os.listdir(root)) == ["step_00000006", "step_99999999999999999999"]


def test_a_run_file_that_is_a_symbolic_link_is_refused(tmp_path, tiny_pretrain_run_args, capsys):
    """samples.jsonl (or any file the run appends to) pointing outside the run directory: one line, exit 2,
    and nothing written through it."""
    import train_my_ddp as T
    out = tmp_path / "run"
    out.mkdir()
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text("")
    os.symlink(outside, out / "samples.jsonl")
    code = T.main([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_CONFIG and len(err) == 1 and "is a symbolic link" in err[0], err
    assert outside.read_text() == ""
