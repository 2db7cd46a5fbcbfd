"""The loss-spike guard: train_my_ddp.py --spike_guard (exit 76, <out_dir>/spike.json),
--skip_data_steps, and monitor_process.py's rollback / replay / skip.

Real runs are the tiny CPU pretraining of tests/conftest.py (8 steps, checkpoints every 3, a 3-step
running median). Spikes are injected by the trainer's fault hooks, keyed on the DATA so that skipping
the data makes them go away: spike_token@T scales the loss (and gradients) of every micro-batch holding
token id T (a corrupt sample in the real shards), spike_data@D that of the step training on data step D,
once per MYLLM_FAULT_ONCE_FILE (a one-off fault of the machine).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from monitor.record import Attempt
from monitor.restarts import classify, with_flag
from tests.conftest import ROOT, run_cmd, run_python
from utils.constants import EXIT_LOSS_SPIKE, NON_RETRYABLE_EXIT_CODES
from utils.spike_guard import SPIKE_FILE, SpikeDetector, format_data_steps, parse_data_steps

TRAIN = os.path.join(ROOT, "train_my_ddp.py")
MONITOR = os.path.join(ROOT, "monitor_process.py")
MAX_ITERS = 8
CKPT = 3  # tiny_pretrain_run_args' --checkpoint_interval
GUARD = ["--spike_guard=true", "--spike_factor=3", "--spike_window=3"]
# the monitor's hang detection must never fire in these tests, however slow the machine
MONITOR_FLAGS = ["--backoff_base=0", "--poll_interval=0.1", "--kill_grace=2", "--hang_timeout=900",
                 "--startup_timeout=900"]
WAIT = 900


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYLLM_FAULT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def records(out) -> dict[int, dict]:
    """step -> its last metrics.jsonl record (a replay re-logs the steps it redoes)."""
    rows = {}
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec:
                rows[rec["step"]] = rec
    return rows


def losses(out) -> dict[int, float]:
    return {s: r["loss"] for s, r in records(out).items()}


def summary(out) -> dict:
    with open(os.path.join(out, "monitor_summary.json")) as f:
        return json.load(f)


def final_state(out) -> dict:
    with open(os.path.join(out, "checkpoints", f"step_{MAX_ITERS:08d}", "trainer_state.json")) as f:
        return json.load(f)


def supervise(cmd: list[str], env: dict, *monitor_flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, MONITOR, *MONITOR_FLAGS, *monitor_flags, "--", *cmd], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=WAIT)


def data_step_tokens(run_args: list[str], n: int) -> list[set[int]]:
    """The token ids of data steps 1..n, read through the trainer's own loader (build_data)."""
    from utils.configurator import parse_config
    from tokenizer import load_tokenizer_meta
    from trainer.config import TrainConfig
    from trainer.task import build_data
    cfg = parse_config(TrainConfig(), run_args)
    loader, _ = build_data(cfg, 0, 1, load_tokenizer_meta(cfg.tokenizer_dir))
    out = []
    for _ in range(n):
        ids: set[int] = set()
        for _ in range(cfg.gradient_accumulation_steps):
            ids |= set(next(loader)["input_ids"].flatten().tolist())
        out.append(ids)
    return out


# --- (c) the detector, the skip-list syntax, the exit code ----------------------------------------

def test_detector_waits_for_its_window_then_flags_k_times_the_median():
    d = SpikeDetector(factor=3.0, window=3)
    for loss in (5.0, 100.0, 4.0):  # warm-up: nothing is judged, even 100
        assert d.check(loss) is None
    assert d.median() == 5.0
    assert d.check(15.0) is None      # == 3 x median is not above it
    assert list(d.recent) == [100.0, 4.0, 15.0]  # the window slides: 5.0 dropped out, median now 15
    spike = d.check(45.01)
    assert spike == {"reason": "spike", "median": 15.0, "threshold": 45.0}
    assert list(d.recent) == [100.0, 4.0, 15.0]  # a spike does not join the window
    assert d.check(30.0) is None and d.median() == 15.0


def test_detector_non_finite_is_a_spike_at_any_time_except_under_fp16():
    d = SpikeDetector(factor=2.0, window=5)
    assert d.check(float("nan"))["reason"] == "non_finite"  # during the warm-up too
    assert d.check(float("inf"))["reason"] == "non_finite"
    assert d.check(float("nan"), nonfinite_is_spike=False) is None  # fp16: the loss scaler skips the step
    assert len(d.recent) == 0


def test_detector_state_round_trip_gives_the_same_verdicts():
    """A resumed run restores the window from the checkpoint and judges as an uninterrupted run."""
    seq = [6.0, 5.5, 5.2, 5.0, 4.9, 16.0, 4.8, 20.0]
    a = SpikeDetector(3.0, 4)
    verdicts_a = [a.check(x) for x in seq]
    b = SpikeDetector(3.0, 4)
    for x in seq[:4]:
        b.check(x)
    c = SpikeDetector(3.0, 4)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    assert [None] * 4 + [c.check(x) for x in seq[4:]] == verdicts_a
    assert [v["reason"] if v else None for v in verdicts_a] == [None] * 5 + ["spike", None, "spike"]
    with pytest.raises(ValueError):
        SpikeDetector(1.0, 3)
    with pytest.raises(ValueError):
        SpikeDetector(3.0, 0)


def test_skip_list_syntax():
    assert parse_data_steps("12,13") == [12, 13]
    assert parse_data_steps(" 3, 10-12,11 ") == [3, 10, 11, 12]
    assert parse_data_steps("") == []
    for bad in ("0", "5-3", "x", "4-", "-4"):
        with pytest.raises(ValueError):
            parse_data_steps(bad)
    assert format_data_steps([8, 1, 2, 3, 5, 7]) == "1-3,5,7-8"
    assert parse_data_steps(format_data_steps([8, 1, 2, 3, 5, 7])) == [1, 2, 3, 5, 7, 8]


def test_exit_code_is_handled_not_retried_blindly_nor_refused():
    assert EXIT_LOSS_SPIKE == 76 and EXIT_LOSS_SPIKE not in NON_RETRYABLE_EXIT_CODES
    assert classify(Attempt(0, [], 0.0, exit_code=EXIT_LOSS_SPIKE)) == "loss_spike"
    assert classify(Attempt(0, [], 0.0, exit_code=1, root_exit_code=EXIT_LOSS_SPIKE)) == "loss_spike"  # torchrun
    assert with_flag(["t.py", "--skip_data_steps", "1", "--x=1"], "--skip_data_steps", "4-5") == \
        ["t.py", "--skip_data_steps=4-5", "--x=1"]


def test_bad_guard_flags_are_one_exit_2_error():
    from trainer.config import TrainConfig, TrainingError
    from trainer.validation import validate_config
    cfg = TrainConfig(data_dir="d", tokenizer_dir="t", spike_factor=1.0, spike_window=0, skip_data_steps="5-3")
    with pytest.raises(TrainingError) as e:
        validate_config(cfg)
    assert e.value.code == 2
    for part in ("--spike_factor=1.0", "--spike_window=0", "--skip_data_steps='5-3'"):
        assert part in str(e.value)


def test_guarded_non_finite_loss_exits_76_not_4(tiny_pretrain_run_args, tmp_path):
    """With the guard on, a NaN loss (during the warm-up too) is a spike: exit 76 and spike.json."""
    out = tmp_path / "nan"
    proc = run_python([sys.executable, TRAIN, *tiny_pretrain_run_args, *GUARD, f"--out_dir={out}",
                       "--max_iters=3"], cwd=ROOT, env=_env(MYLLM_FAULT="nan_loss@2"))
    assert proc.returncode == EXIT_LOSS_SPIKE, proc.stderr[-2000:]
    assert "loss spike at step 2 (data step 2): loss nan is non-finite" in proc.stderr and "Traceback" not in proc.stderr
    with open(out / SPIKE_FILE) as f:
        rec = json.load(f)
    assert (rec["step"], rec["data_step"], rec["reason"], rec["loss"]) == (2, 2, "non_finite", "nan")
    assert sorted(losses(out)) == [1]  # the spike step is not logged


# --- the supervisor's bookkeeping, against a torch-free child that always spikes ----------------

ALWAYS_SPIKES = r'''
import json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
out = args["out_dir"]
root = os.path.join(out, "checkpoints")
done = sorted(int(n[5:]) for n in os.listdir(root) if os.path.exists(os.path.join(root, n, "COMPLETE")))
if os.environ.get("WRITE_RECORD") == "1":
    resumed = max(done, default=0)
    with open(os.path.join(out, "spike.json"), "w") as f:
        json.dump({"step": 5, "data_step": 5, "loss": 99.0, "median": 5.0, "reason": "spike",
                   "resumed_from": {"step": resumed, "data_step": resumed}}, f)
print("[rank 0] error: loss spike at step 5", file=sys.stderr)
sys.exit(76)
'''


def _fake_run(tmp_path, write_record: bool, *monitor_flags: str):
    child = tmp_path / "child.py"
    child.write_text(ALWAYS_SPIKES)
    out = tmp_path / "run"
    for step in (3, 6, 9):  # 6 and 9 come after the spike at 5 (left by an earlier, luckier attempt)
        os.makedirs(out / "checkpoints" / f"step_{step:08d}")
        (out / "checkpoints" / f"step_{step:08d}" / "COMPLETE").write_text("ok\n")
    (out / "run_start.json").write_text("{}")
    cmd = [sys.executable, str(child), f"--out_dir={out}", "--init_from=scratch"]
    return out, cmd, supervise(cmd, _env(WRITE_RECORD="1" if write_record else "0"), *monitor_flags)


def test_monitor_rolls_back_replays_skips_and_gives_up_after_max_spike_events(tmp_path):
    out, cmd, r = _fake_run(tmp_path, True, "--max_spike_events=1", "--max_restarts=0")
    assert r.returncode == EXIT_LOSS_SPIKE, r.stderr
    s = summary(out)
    assert s["final_status"] == "gave_up" and "--max_spike_events=1" in s["reason"]
    assert [a["cause"] for a in s["attempts"]] == ["loss_spike"] * 3
    assert (s["restarts"], s["counted_restarts"]) == (2, 0)  # not charged to --max_restarts=0
    (event,) = s["spike_guard"]["events"]
    assert (event["step"], event["rolled_back_to_step"], event["reproduced"], event["verdict"]) == (5, 3, True, "data")
    assert event["moved_aside"] == ["checkpoints_after_spike/step_00000006", "checkpoints_after_spike/step_00000009"]
    assert event["skipped_data_steps"] == [4, 5] and s["spike_guard"]["skip_data_steps"] == [4, 5]
    # moved, never deleted; the checkpoint before the spike stays where a resume finds it
    assert sorted(os.listdir(out / "checkpoints_after_spike")) == ["step_00000006", "step_00000009"]
    assert os.listdir(out / "checkpoints") == ["step_00000003"]
    replay, skipping = s["attempts"][1]["command"], s["attempts"][2]["command"]
    assert replay == cmd  # the trainer continues its run by itself (--resume=auto)
    assert skipping == cmd + ["--skip_data_steps=4-5"]
    assert "reproduced on the replay" in r.stderr and "skipping data steps 4-5" in r.stderr


def test_monitor_stops_when_the_spike_left_no_record(tmp_path):
    out, _, r = _fake_run(tmp_path, False)
    assert r.returncode == EXIT_LOSS_SPIKE, r.stderr
    s = summary(out)
    assert s["final_status"] == "non_retryable" and SPIKE_FILE in s["reason"]
    assert len(s["attempts"]) == 1 and len(os.listdir(out / "checkpoints")) == 3  # nothing moved


# --- (a) a reproducible spike from a corrupt sample in the real shards ---------------------------

def test_reproducible_spike_is_rolled_back_replayed_and_its_data_skipped(tiny_pretrain_run_args, tmp_path):
    args = [*tiny_pretrain_run_args, *GUARD, f"--max_iters={MAX_ITERS}"]
    # the "corrupt sample": a token id that occurs in exactly one data step D of the run (nowhere else in
    # the data the run reads, whatever it skips); D after the guard's warm-up and after a checkpoint,
    # preferably with a data step between them, so that the skipped window has two steps
    steps = data_step_tokens(args, MAX_ITERS + 2)
    found = None
    for d in (5, 8, 4, 7):
        only_here = steps[d - 1].difference(*(t for i, t in enumerate(steps) if i != d - 1))
        if only_here:
            found = d, min(only_here)
            break
    assert found, "no token id occurs in exactly one data step of the tiny corpus"
    spike_at, token = found
    checkpoint = (spike_at - 1) // CKPT * CKPT
    window = list(range(checkpoint + 1, spike_at + 1))

    out = tmp_path / "supervised"
    cmd = [sys.executable, TRAIN, *args, f"--out_dir={out}"]
    r = supervise(cmd, _env(MYLLM_FAULT=f"spike_token@{token}"))
    assert r.returncode == 0, r.stderr[-4000:]
    s = summary(out)
    assert s["final_status"] == "completed"
    assert [a["cause"] for a in s["attempts"]] == ["loss_spike", "loss_spike", "completed"]
    (event,) = s["spike_guard"]["events"]
    assert (event["step"], event["data_step"], event["reason"]) == (spike_at, spike_at, "spike")
    assert event["loss"] > 3 * event["median"]
    assert (event["rolled_back_to_step"], event["reproduced"], event["verdict"]) == (checkpoint, True, "data")
    assert event["skipped_data_steps"] == window and s["spike_guard"]["skip_data_steps"] == window
    assert s["attempts"][2]["command"][-1] == f"--skip_data_steps={format_data_steps(window)}"
    # the skipped data steps are exactly the recorded ones: the metrics say which data each step
    # trained on and what it discarded, the checkpoint keeps the list for later resumes
    rows = records(out)
    assert sorted(rows) == list(range(1, MAX_ITERS + 1))
    trained = [rows[i]["data_step"] for i in range(1, MAX_ITERS + 1)]
    assert trained == [d for d in range(1, MAX_ITERS + len(window) + 1) if d not in window]
    assert [(i, rows[i]["skipped_data_steps"]) for i in rows if "skipped_data_steps" in rows[i]] == \
        [(checkpoint + 1, window)]
    assert final_state(out)["skip_data_steps"] == window and final_state(out)["data_step"] == MAX_ITERS + len(window)
    assert spike_at in window and all(token not in steps[d - 1] for d in trained)
    with open(out / SPIKE_FILE) as f:
        assert json.load(f)["resumed_from"] == {"step": checkpoint, "data_step": checkpoint}  # the replay's

    # the same skip list given up front, no supervisor, no fault: the same run, step for step
    ref = tmp_path / "skip_up_front"
    run_cmd([sys.executable, TRAIN, *args, f"--out_dir={ref}", f"--skip_data_steps={format_data_steps(window)}"],
            env=_env())
    assert losses(ref) == losses(out)
    assert [records(ref)[i]["data_step"] for i in range(1, MAX_ITERS + 1)] == trained


# --- (b) a one-off spike (a fault of the machine) -------------------------------------------------

def test_one_off_spike_is_replayed_blamed_on_the_machine_and_nothing_skipped(tiny_pretrain_run_args, tmp_path):
    args = [*tiny_pretrain_run_args, *GUARD, f"--max_iters={MAX_ITERS}"]
    spike_at = 5
    out = tmp_path / "supervised"
    once = tmp_path / "fired"
    r = supervise([sys.executable, TRAIN, *args, f"--out_dir={out}"],
                  _env(MYLLM_FAULT=f"spike_data@{spike_at}", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert r.returncode == 0, r.stderr[-4000:]
    assert once.exists()
    s = summary(out)
    assert s["final_status"] == "completed"
    assert [a["cause"] for a in s["attempts"]] == ["loss_spike", "completed"]
    assert s["attempts"][1]["resumed_from_step"] == CKPT and s["attempts"][1]["first_step"] == CKPT + 1
    assert s["attempts"][0]["steps_lost"] == spike_at - 1 - CKPT
    (event,) = s["spike_guard"]["events"]
    assert (event["step"], event["reproduced"], event["verdict"], event["skipped_data_steps"]) == \
        (spike_at, False, "machine", [])
    assert math.isfinite(event["replay_loss"]) and event["replay_loss"] < event["loss"] / 3
    assert s["spike_guard"]["skip_data_steps"] == []
    assert "did NOT reproduce" in r.stderr and "--skip_data_steps" not in " ".join(s["attempts"][1]["command"])
    assert not any("skipped_data_steps" in rec for rec in records(out).values())
    assert final_state(out)["skip_data_steps"] == []

    ref = tmp_path / "uninterrupted"
    run_cmd([sys.executable, TRAIN, *args, f"--out_dir={ref}"], env=_env())
    assert losses(out) == losses(ref)
