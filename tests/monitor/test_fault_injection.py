"""Fault-injection tests of monitor_process.py against tests/fake_train.py (fast, torch-free child).

Timing rules, so that the tests hold on a machine several times slower than a developer's and busy:
faults are injected deterministically (MYLLM_FAULT=hang@S parks the child), the tests wait for
events (log lines, metrics, files) with generous deadlines instead of sleeping fixed times, and the
monitor's own timeouts are far above what a healthy child needs: a healthy run never comes near
--hang_timeout or --startup_timeout, so they only decide how long a hang test waits.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from monitor.config import parse_args
from monitor.restarts import flag_value, with_resume
from monitor.run_files import torchrun_root_cause_exit_code
from monitor.supervisor import Monitor
from utils.proc_tree import process_info

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MONITOR = os.path.join(ROOT, "monitor_process.py")
FAKE = os.path.join(ROOT, "tests", "fake_train.py")
HANG_TIMEOUT = 8        # a healthy fake step (even a checkpoint save on a busy disk) beats this by far
STARTUP_TIMEOUT = 300   # torchrun imports torch: tens of seconds on a slow, loaded machine
WAIT = 300              # deadline of every wait for an event; a passing test never reaches it
FAST = ["--backoff_base=0.05", "--backoff_max=0.2", "--poll_interval=0.05", "--kill_grace=0.5",
        f"--hang_timeout={HANG_TIMEOUT}", f"--startup_timeout={STARTUP_TIMEOUT}"]


def fake_cmd(out_dir, *extra: str) -> list[str]:
    return [sys.executable, FAKE, f"--out_dir={out_dir}", "--max_iters=12", "--checkpoint_interval=5",
            *extra]


def run_monitor(cmd: list[str], monitor_args=(), env_extra=None, timeout=WAIT):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, MONITOR, *FAST, *monitor_args, "--", *cmd],
                          env=env, capture_output=True, text=True, timeout=timeout)


def losses(out_dir) -> dict[int, float]:
    """Loss per step, last occurrence wins (a resumed run logs the redone steps again)."""
    out = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            out[rec["step"]] = rec["loss"]
    return out


def summary(out_dir) -> dict:
    with open(os.path.join(out_dir, "monitor_summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("ref")
    subprocess.run(fake_cmd(out), check=True, capture_output=True)
    return losses(out)


def assert_all_dead(out_dir) -> None:
    """Every process the fake trainer ever started (pid files) is gone: no orphaned ranks."""
    pids = [int(n.rsplit("_", 1)[1]) for n in os.listdir(out_dir) if n.startswith("pid_rank")]
    assert pids
    for pid in pids:
        info = process_info(pid)
        assert info is None or info.state == "Z", f"process {pid} of the training is still alive"


# --- pure helpers ------------------------------------------------------------------------------

def test_with_resume_leaves_the_command_unless_it_says_never_and_keeps_spaces():
    """The trainer continues its run by itself (--resume=auto): a restart is the command as given; only
    --resume=never becomes --resume=always (in place, in either spelling)."""
    for cmd in (["t.py", "--init_from=scratch", "--x=a b"], ["t.py", "--init_from=resume"],
                ["t.py", "--resume=auto"], ["t.py", "--resume=always"], ["torchrun", "--nproc_per_node=2", "t.py"]):
        assert with_resume(cmd) == cmd
    assert with_resume(["t.py", "--resume=never", "--x=a b"]) == ["t.py", "--resume=always", "--x=a b"]
    assert with_resume(["t.py", "--resume", "never", "y"]) == ["t.py", "--resume=always", "y"]
    assert flag_value(["a", "--out_dir=x y", "--out_dir", "z"], "--out_dir") == "z"


def test_torchrun_root_cause_is_read_from_its_report():
    tail = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
            "Failures:\n  <NO_OTHER_FAILURES>\nRoot Cause (first observed failure):\n[0]:\n"
            "  rank      : 1 (local_rank: 1)\n  exitcode  : 2 (pid: 5031) \n")
    assert torchrun_root_cause_exit_code(tail) == 2
    assert torchrun_root_cause_exit_code("exitcode : 2") is None


def test_command_must_follow_double_dash():
    with pytest.raises(SystemExit):
        parse_args(["--max_restarts=1", "python", "t.py"])
    cfg, cmd = parse_args(["--max_restarts=1", "--", "python", "t.py", "--out_dir=/o d"])
    assert cmd == ["python", "t.py", "--out_dir=/o d"] and cfg.out_dir == "/o d"
    assert cfg.log_file == os.path.join("/o d", "monitor.log")


def test_monitor_flags_follow_the_commands_convention(capsys):
    """No prefix guessing (a misspelt flag is refused with the right name, never taken for another), dashes as
    underscores, booleans as --name[=true|false]; the command after `--` is not read."""
    with pytest.raises(SystemExit) as e:
        parse_args(["--max_restart=2", "--", "python", "t.py"])
    assert e.value.code == 2 and "did you mean --max_restarts" in capsys.readouterr().err
    cfg, cmd = parse_args(["--max-restarts=3", "--count_only_stalled_restarts", "--", "python", "t.py", "--max_restart=9"])
    assert (cfg.max_restarts, cfg.count_only_stalled_restarts, cmd[-1]) == (3, True, "--max_restart=9")
    assert parse_args(["--count_only_stalled_restarts=false", "--", "x"])[0].count_only_stalled_restarts is False
    assert parse_args(["--", "x"])[0].count_only_stalled_restarts is False


# --- fault injection ---------------------------------------------------------------------------

@pytest.mark.parametrize("fault, resumed_from, cause", [("crash@7", 5, "crash"),
                                                        ("kill_in_save@10", 5, "signal")])
def test_crash_is_restarted_and_resumes_exactly(tmp_path, reference, fault, resumed_from, cause):
    out = tmp_path / "run"
    label = "two  spaces 'and' \"quotes\""
    r = run_monitor(fake_cmd(out, f"--label={label}"),
                    env_extra={"MYLLM_FAULT": fault, "MYLLM_FAULT_ONCE_FILE": str(tmp_path / "once")})
    assert r.returncode == 0, r.stderr
    assert losses(out) == reference
    s = summary(out)
    assert (s["final_status"], s["exit_code"], s["restarts"]) == ("completed", 0, 1)
    first, second = s["attempts"]
    assert first["cause"] == cause
    if cause == "signal":
        assert first["signal"] == "SIGKILL"
        # the torn step_10 was never marked COMPLETE; the retry rewrote it
        assert os.path.exists(out / "checkpoints" / "step_00000010" / "COMPLETE")
    else:
        assert first["exit_code"] == 1
    assert second["resumed_from_step"] == resumed_from
    assert first["steps_lost"] == first["last_step"] - resumed_from
    assert 0 < first["steps_lost"] <= 5  # at most the checkpoint interval
    assert second["first_step"] == resumed_from + 1 and s["last_step"] == 12
    assert second["command"] == first["command"]  # unchanged: the trainer continues its run by itself
    # the argument with spaces and quotes reached the restarted trainer as one argument
    with open(out / "args.json") as f:
        assert f"--label={label}" in json.load(f)
    with open(out / "monitor.log") as f:
        log = f.read()
    assert "step 12 loss" in log and "restarting in" in log


@pytest.mark.parametrize("fault, startup_timeout, cause", [("hang@7", STARTUP_TIMEOUT, "hang"),
                                                          ("hang@1", 8, "startup_timeout")])
def test_hang_is_killed_and_restarted(tmp_path, reference, fault, startup_timeout, cause):
    # hang@1 parks the first attempt before its first heartbeat: only --startup_timeout can end it,
    # and the restarted (torch-free) fake trainer needs well under a second to its first heartbeat
    out = tmp_path / "run"
    r = run_monitor(fake_cmd(out), [f"--startup_timeout={startup_timeout}"],
                    env_extra={"MYLLM_FAULT": fault, "MYLLM_FAULT_ONCE_FILE": str(tmp_path / "once")})
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["restarts"] == 1 and s["attempts"][0]["cause"] == cause
    assert s["attempts"][0]["signal"] in ("SIGTERM", "SIGKILL")
    assert losses(out) == reference
    assert_all_dead(out)


def test_bad_config_is_not_restarted(tmp_path):
    out = tmp_path / "run"
    r = run_monitor(fake_cmd(out, "--no_such_flag=1"))
    assert r.returncode == 2
    s = summary(out)
    assert (s["final_status"], s["restarts"], len(s["attempts"])) == ("non_retryable", 0, 1)
    assert "exit code 2 is not retryable" in s["reason"]
    assert "non_retryable" in r.stderr


@pytest.mark.parametrize("code", [3, 4, 5, 7])
def test_named_errors_are_not_restarted(tmp_path, code):
    """3 bad data, 4 non-finite loss, 5 unusable checkpoint, 7 disk full (utils/constants.py) end the run like 2."""
    out = tmp_path / "run"
    r = run_monitor(fake_cmd(out, f"--exit_at_start={code}"))
    assert r.returncode == code, r.stderr
    s = summary(out)
    assert (s["final_status"], s["restarts"], len(s["attempts"])) == ("non_retryable", 0, 1)
    assert f"exit code {code} is not retryable" in s["reason"]


def test_finished_run_is_never_restarted(tmp_path, reference):
    out = tmp_path / "run"
    r = run_monitor(fake_cmd(out))
    assert r.returncode == 0
    s = summary(out)
    assert (s["final_status"], s["restarts"], len(s["attempts"])) == ("completed", 0, 1)
    assert s["attempts"][0]["steps_lost"] == 0 and s["total_steps_lost"] == 0
    assert losses(out) == reference


def test_sigterm_to_monitor_is_forwarded_and_not_restarted(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, MONITOR, *FAST, "--", *fake_cmd(out, "--max_iters=100000", "--step_time=0.02")]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: os.path.exists(out / "metrics.jsonl") and len(losses(out)) >= 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 75, err
    s = summary(out)
    assert (s["final_status"], s["restarts"], len(s["attempts"])) == ("stopped", 0, 1)
    assert s["attempts"][0]["exit_code"] == 75
    # the trainer saved the step it was on when the signal arrived
    last = s["last_step"]
    assert os.path.exists(out / "checkpoints" / f"step_{last:08d}" / "COMPLETE")
    assert_all_dead(out)


@pytest.mark.parametrize("only_stalled, attempts", [(False, 2), (True, 3)])
def test_max_restarts_is_honoured(tmp_path, only_stalled, attempts):
    # crash@7 fires on every attempt: attempt 0 makes progress (steps 1..6, checkpoint 5),
    # later attempts resume at 5, redo step 6 and crash again without progress.
    out = tmp_path / "run"
    flags = ["--max_restarts=1"] + (["--count_only_stalled_restarts"] if only_stalled else [])
    r = run_monitor(fake_cmd(out), flags, env_extra={"MYLLM_FAULT": "crash@7"})
    assert r.returncode == 1
    s = summary(out)
    assert s["final_status"] == "gave_up" and len(s["attempts"]) == attempts
    assert s["restarts"] == attempts - 1 and s["counted_restarts"] == 1
    assert [a["made_progress"] for a in s["attempts"]] == [True] + [False] * (attempts - 1)
    assert all(a["cause"] == "crash" for a in s["attempts"])


# --- under torchrun: workers live in their own sessions, the agent hides their exit codes -------

def torchrun_cmd(out_dir, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            *fake_cmd(out_dir, *extra)[1:]]


def test_torchrun_hang_kills_every_rank_and_restarts(tmp_path, reference):
    # a slow torchrun start (torch import under load) must not count as a hang: STARTUP_TIMEOUT
    out = tmp_path / "run"
    r = run_monitor(torchrun_cmd(out), [],
                    env_extra={"MYLLM_FAULT": "hang@7", "MYLLM_FAULT_ONCE_FILE": str(tmp_path / "once")})
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert s["restarts"] == 1 and s["attempts"][0]["cause"] == "hang"
    assert losses(out) == reference
    assert_all_dead(out)  # the hung worker was in its own session, not in torchrun's group


def test_torchrun_worker_bad_config_is_not_restarted(tmp_path):
    out = tmp_path / "run"
    r = run_monitor(torchrun_cmd(out, "--no_such_flag=1"))
    assert r.returncode == 2, r.stderr
    s = summary(out)
    assert s["final_status"] == "non_retryable" and s["restarts"] == 0
    assert (s["attempts"][0]["exit_code"], s["attempts"][0]["root_exit_code"]) == (1, 2)


# --- stop paths --------------------------------------------------------------------------------

def start_monitor(cmd: list[str], monitor_args=(), env_extra=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, MONITOR, *FAST, *monitor_args, "--", *cmd],
                            env=dict(os.environ, **(env_extra or {})),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout: float = WAIT) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


def test_sigterm_during_backoff_stops_without_restart(tmp_path):
    out = tmp_path / "run"
    proc = start_monitor(fake_cmd(out), ["--backoff_base=30", "--backoff_max=30"], {"MYLLM_FAULT": "crash@2"})
    wait_for(lambda: os.path.exists(out / "monitor.log") and "restarting in 30s" in open(out / "monitor.log").read())
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=WAIT)
    assert proc.returncode == 75
    s = summary(out)
    assert (s["final_status"], s["restarts"], len(s["attempts"])) == ("stopped", 0, 1)


def test_second_signal_kills_a_stuck_run(tmp_path):
    # parked in hang@3, the trainer only sets a flag on SIGTERM; the second SIGINT kills the tree
    out = tmp_path / "run"
    proc = start_monitor(fake_cmd(out), ["--hang_timeout=0"], {"MYLLM_FAULT": "hang@3"})
    # wait until the child is parked (its "[fault] hang@3" line teed into monitor.log): two logged losses are not
    # enough, a signal landing between step 2's metrics line and its stop-flag check ends the run cleanly (75)
    wait_for(lambda: os.path.exists(out / "monitor.log") and "[fault] hang@3" in open(out / "monitor.log").read())
    assert len(losses(out)) == 2
    proc.send_signal(signal.SIGINT)
    # the monitor has taken the first signal (it says so) and keeps waiting for a save that never comes
    wait_for(lambda: "received SIGINT: forwarded" in open(out / "monitor.log").read())
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=WAIT)
    assert proc.returncode == 128 + signal.SIGKILL
    s = summary(out)
    assert (s["final_status"], s["restarts"]) == ("stopped", 0)
    assert s["attempts"][0]["signal"] == "SIGKILL"
    assert_all_dead(out)


def test_trainer_interrupted_by_someone_else_is_not_restarted(tmp_path):
    out = tmp_path / "run"
    proc = start_monitor(fake_cmd(out, "--max_iters=100000", "--step_time=0.02"))
    wait_for(lambda: os.path.exists(out / "metrics.jsonl") and len(losses(out)) >= 2)
    trainer_pid = next(int(n.rsplit("_", 1)[1]) for n in os.listdir(out) if n.startswith("pid_rank0"))
    os.kill(trainer_pid, signal.SIGTERM)  # e.g. an operator or a scheduler signalled the trainer only
    proc.communicate(timeout=WAIT)
    assert proc.returncode == 75
    s = summary(out)
    assert (s["final_status"], s["restarts"], s["attempts"][0]["exit_code"]) == ("interrupted", 0, 75)


def test_missing_executable_is_reported_not_retried(tmp_path):
    r = run_monitor([str(tmp_path / "no such python"), "train.py"],
                    [f"--summary_file={tmp_path / 's.json'}", f"--log_file={tmp_path / 'm.log'}"])
    assert r.returncode == 127
    with open(tmp_path / "s.json") as f:
        s = json.load(f)
    assert (s["final_status"], s["restarts"], len(s["attempts"])) == ("failed_to_start", 0, 1)
    assert "no such python" in s["reason"]


def test_help_works_alone_and_exits_0():
    """`monitor_process.py --help` prints the real help (not one usage line and exit 1)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "monitor_process.py"), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--max_restarts" in r.stdout and "--hang_timeout" in r.stdout and "never restarted" in r.stdout
    r = subprocess.run([sys.executable, os.path.join(ROOT, "monitor_process.py"), "--max_restarts=2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "must follow `--`" in r.stderr


def test_out_dir_is_found_under_its_alias():
    cfg, _ = parse_args(["--", "python", "train_my_ddp.py", "--output_dir=/runs/a"])
    assert cfg.out_dir == "/runs/a"


# --- killed during start-up, before the trainer recorded how the run starts --------------------

# A stand-in for the trainer's start-up contract (train_my_ddp.py `start_without_checkpoint`): it
# writes <out_dir>/run_start.json before its first step, and `--resume=always` (`--init_from=resume`)
# with neither that record nor a checkpoint exits 2. KILL_WHERE says where the first start is SIGKILLed
# (as an OOM killer or an operator would), once per KILL_ONCE_FILE.
STARTUP_CHILD = r'''
import json, os, signal, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
out, init = args["out_dir"], args.get("init_from", "scratch")
policy = "always" if init == "resume" else args.get("resume", "auto")
os.makedirs(out, exist_ok=True)
record = os.path.join(out, "run_start.json")
with open(os.path.join(out, "starts.jsonl"), "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
if policy == "always" and not os.path.exists(record) and not os.path.isdir(os.path.join(out, "checkpoints")):
    print("[rank 0] error: --resume=always: no complete checkpoint and no record of how the run started",
          file=sys.stderr)
    sys.exit(2)

def killed_at(point):
    once = os.environ["KILL_ONCE_FILE"]
    if os.environ["KILL_WHERE"] == point and not os.path.exists(once):
        open(once, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

killed_at("before_record")
if not os.path.exists(record):
    with open(record, "w") as f:
        json.dump({"init_from": init}, f)
killed_at("after_record")
with open(os.path.join(out, "metrics.jsonl"), "a") as f:
    f.write(json.dumps({"step": 1, "loss": 1.0}) + "\n")
'''


@pytest.mark.parametrize("where, resume, restart_resume", [
    ("before_record", "--resume=auto", "--resume=auto"), ("after_record", "--resume=auto", "--resume=auto"),
    ("before_record", "--resume=never", "--resume=never"), ("after_record", "--resume=never", "--resume=always")])
def test_kill_during_startup_restarts_the_way_the_run_would_start(tmp_path, where, resume, restart_resume):
    """The trainer continues its run by itself (--resume=auto): every restart is the user's command,
    unchanged. A command that says --resume=never is restarted with --resume=always once the run
    recorded its start (run_start.json); killed before that, unchanged: --resume=always would exit 2
    and end the run as non-retryable."""
    child = tmp_path / "child.py"
    child.write_text(STARTUP_CHILD)
    out = tmp_path / "run"
    cmd = [sys.executable, str(child), f"--out_dir={out}", "--init_from=scratch", resume]
    r = run_monitor(cmd, env_extra={"KILL_WHERE": where, "KILL_ONCE_FILE": str(tmp_path / "killed")})
    assert r.returncode == 0, r.stderr
    s = summary(out)
    assert (s["final_status"], s["restarts"]) == ("completed", 1), s["reason"]
    first, second = s["attempts"]
    assert first["signal"] == "SIGKILL" and first["cause"] == "signal"
    assert second["command"] == cmd[:-1] + [restart_resume]
    with open(out / "starts.jsonl") as f:
        assert [json.loads(line)[1:] for line in f] == [["--init_from=scratch", resume],
                                                         ["--init_from=scratch", restart_resume]]
    log = (out / "monitor.log").read_text()
    expected = "--resume=always in place of" if restart_resume != resume else "the original command, unchanged"
    assert expected in log and subprocess.list2cmdline(second["command"]) in log


def test_unknown_out_dir_restarts(tmp_path):
    """Without an out_dir the monitor cannot look for the record: the command is restarted as it is
    (the trainer continues its run), and --resume=never becomes --resume=always."""
    for cmd, want in ((["python", "t.py", "--init_from=scratch"], ["python", "t.py", "--init_from=scratch"]),
                      (["python", "t.py", "--resume=never"], ["python", "t.py", "--resume=always"])):
        m = Monitor(parse_args(["--", *cmd])[0], cmd)
        command, how = m.restart_command()
        assert command == want and ("unchanged" in how) == (cmd == want), how
        m.log.close()


SITECUSTOMIZE = r'''
import os, signal, sys
once = os.environ.get("MYLLM_TEST_KILL_AT_START_ONCE")
if once and sys.argv and sys.argv[0].endswith("train_my_ddp.py") and not os.path.exists(once):
    open(once, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)  # in interpreter start-up: long before run_start.json
'''


def test_real_trainer_killed_before_it_recorded_its_start_completes(tmp_path, tiny_pretrain_run_args):
    """The real train_my_ddp.py, SIGKILLed as its interpreter starts (a sitecustomize.py on PYTHONPATH,
    once): the monitor restarts the original command and the run completes (it used to resume, which
    exits 2 with "no record of how the run started", and stop as non-retryable)."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "train_my_ddp.py"), *tiny_pretrain_run_args, f"--out_dir={out}",
           "--max_iters=2", "--init_from=scratch"]
    env = {"PYTHONPATH": os.pathsep.join([str(inject)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
           "MYLLM_TEST_KILL_AT_START_ONCE": str(tmp_path / "killed"), "OMP_NUM_THREADS": "1"}
    r = run_monitor(cmd, env_extra=env)
    assert r.returncode == 0, r.stderr[-3000:]
    s = summary(out)
    assert (s["final_status"], s["restarts"]) == ("completed", 1), s["reason"]
    assert s["attempts"][0]["signal"] == "SIGKILL" and s["attempts"][1]["command"] == cmd
    assert sorted(losses(out)) == [1, 2] and (out / "run_start.json").exists()
