"""monitor_process.py around the real train_my_ddp.py: SIGKILL at a random step (one process, and
torchrun with 2 workers) and SIGKILL in the middle of a checkpoint save must all end with the loss
sequence of an uninterrupted run.

The "random" step is drawn from a seeded generator and reached deterministically: the trainer's
hang@S hook parks it at step S, then the test SIGKILLs it. Without the hook a tiny model finishes
faster than a test can poll. The seed is in every assertion message.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from monitor.restarts import flag_value
from utils.proc_tree import descendants

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MONITOR = os.path.join(ROOT, "monitor_process.py")
TRAIN = os.path.join(ROOT, "train_my_ddp.py")
MAX_ITERS = 6
CKPT_INTERVAL = 3  # set by the tiny_pretrain_run_args fixture
SEED = int(os.environ.get("MYLLM_MONITOR_TEST_SEED", "20261121"))
# The test kills the parked trainer itself: the monitor's hang detection must never fire first, even
# on a slow, busy machine (torch import and set-up can take minutes there), so its timeouts are huge.
WAIT = 600  # deadline of every wait; a passing test never reaches it
MONITOR_FLAGS = ["--backoff_base=0.1", "--poll_interval=0.1", "--kill_grace=2", f"--hang_timeout={WAIT}",
                 f"--startup_timeout={WAIT}"]

pytestmark = pytest.mark.slow


def run_cmd(args: list[str]) -> None:
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=WAIT)
    assert proc.returncode == 0, f"reference run exited {proc.returncode}:\n{proc.stderr[-4000:]}"


def single(args: list[str], out) -> list[str]:
    return [sys.executable, TRAIN, *args, f"--out_dir={out}", f"--max_iters={MAX_ITERS}"]


def torchrun(args: list[str], out) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            TRAIN, *args, f"--out_dir={out}", f"--max_iters={MAX_ITERS}"]


def losses(out) -> dict[int, float]:
    """Loss per step, deduplicated by step, last occurrence wins (resumes re-log redone steps)."""
    seq = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            seq[int(rec["step"])] = float(rec["loss"])
    return seq


def summary(out) -> dict:
    with open(os.path.join(out, "monitor_summary.json")) as f:
        return json.load(f)


def start_monitor(cmd: list[str], env_extra: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, MONITOR, *MONITOR_FLAGS, "--", *cmd], cwd=ROOT,
                            env=dict(os.environ, **env_extra), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def training_processes(root_pid: int) -> list[int]:
    """Descendants of root_pid running train_my_ddp.py as their script (the ranks, not torchrun's agent)."""
    found = []
    for pid in descendants(root_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"torch.distributed.run" not in argv and any(a.endswith(b"train_my_ddp.py") for a in argv):
            found.append(pid)
    return found


def sigkill_when_parked(monitor: subprocess.Popen, once_file: str, want: int) -> list[int]:
    """Wait until the hang hook fired (it writes once_file), then SIGKILL every training rank, as
    the OOM killer or a lost node would. (Killing only the other rank of two would leave torchrun
    waiting 30 s for the parked one, which ignores SIGTERM while parked.)"""
    deadline = time.time() + WAIT
    while time.time() < deadline:
        assert monitor.poll() is None, monitor.stderr.read()
        pids = training_processes(monitor.pid)
        if os.path.exists(once_file) and len(pids) == want:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return pids
        time.sleep(0.05)
    raise AssertionError("the training never reached the hang hook")


def check_resumed_run(out, reference: dict, monitor: subprocess.Popen, msg: str) -> dict:
    _, err = monitor.communicate(timeout=WAIT)
    assert monitor.returncode == 0, f"{msg}\n{err[-4000:]}"
    s = summary(out)
    assert s["final_status"] == "completed" and s["restarts"] == 1, msg
    got = losses(out)
    assert sorted(got) == sorted(reference), msg
    assert [got[k] for k in sorted(got)] == pytest.approx([reference[k] for k in sorted(reference)],
                                                           rel=1e-6, abs=1e-7), msg
    first, second = s["attempts"]
    assert 0 <= first["steps_lost"] <= CKPT_INTERVAL, msg
    assert second["command"] == first["command"], msg  # the trainer continues its run by itself
    return s


@pytest.fixture(scope="module")
def single_reference(tiny_pretrain_run_args, tmp_path_factory) -> dict:
    # the kill steps and the steps-lost bound below assume the fixture's checkpoint interval
    assert flag_value(tiny_pretrain_run_args, "--checkpoint_interval") == str(CKPT_INTERVAL)
    out = tmp_path_factory.mktemp("ref_single")
    run_cmd(single(tiny_pretrain_run_args, out))
    return losses(out)


def test_sigkill_at_random_step_single_process(tiny_pretrain_run_args, single_reference, tmp_path):
    rng = random.Random(SEED)
    step = rng.randrange(2, MAX_ITERS)
    msg = f"seed={SEED} step={step}"
    out, once = tmp_path / "run", str(tmp_path / "once")
    monitor = start_monitor(single(tiny_pretrain_run_args, out),
                            {"MYLLM_FAULT": f"hang@{step}", "MYLLM_FAULT_ONCE_FILE": once})
    sigkill_when_parked(monitor, once, 1)
    s = check_resumed_run(out, single_reference, monitor, msg)
    assert (s["attempts"][0]["cause"], s["attempts"][0]["signal"]) == ("signal", "SIGKILL"), msg


def test_sigkill_during_checkpoint_save_resumes_from_previous(tiny_pretrain_run_args, single_reference, tmp_path):
    out, once = tmp_path / "run", tmp_path / "once"
    monitor = start_monitor(single(tiny_pretrain_run_args, out),
                            {"MYLLM_FAULT": f"kill_in_save@{2 * CKPT_INTERVAL}", "MYLLM_FAULT_ONCE_FILE": str(once)})
    s = check_resumed_run(out, single_reference, monitor, "kill_in_save")
    assert once.exists(), "the kill_in_save hook never fired"
    first, second = s["attempts"]
    assert first["signal"] == "SIGKILL"
    assert second["resumed_from_step"] == CKPT_INTERVAL  # the torn save was skipped, the previous one loaded


def test_sigkill_the_ranks_under_torchrun(tiny_pretrain_run_args, tmp_path):
    assert flag_value(tiny_pretrain_run_args, "--checkpoint_interval") == str(CKPT_INTERVAL)
    rng = random.Random(SEED + 1)
    step = rng.randrange(2, MAX_ITERS)
    msg = f"seed={SEED + 1} step={step}"
    ref = tmp_path / "ref"
    run_cmd(torchrun(tiny_pretrain_run_args, ref))
    out, once = tmp_path / "run", str(tmp_path / "once")
    monitor = start_monitor(torchrun(tiny_pretrain_run_args, out),
                            {"MYLLM_FAULT": f"hang@{step}", "MYLLM_FAULT_ONCE_FILE": once})
    sigkill_when_parked(monitor, once, 2)
    s = check_resumed_run(out, losses(ref), monitor, msg)
    assert s["attempts"][0]["cause"] in ("crash", "signal"), msg
