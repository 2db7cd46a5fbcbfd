"""CPU threads (utils/threads.py and the trainer's use of it): the thread count is chosen from --threads,
OMP_NUM_THREADS (torchrun's per-rank 1) or the usable cores, said in the [layout] line; an automatic count
is tuned against one thread by measuring; an oversubscribed machine is warned about once."""
from __future__ import annotations

import os
import pytest

from tests.conftest import run_cmd, run_trainer, train_cmd
from utils import threads


def test_choose_threads_follows_flag_then_environment_then_usable_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)  # 3 of the machine's cores
    assert threads.usable_cores() == 3
    assert threads.choose_threads(0, env={}) == threads.ThreadChoice(3, "3 usable cores")
    assert threads.choose_threads(0, env={"LOCAL_WORLD_SIZE": "2"}).threads == 1  # two ranks share the 3 cores
    assert threads.choose_threads(0, env={"LOCAL_WORLD_SIZE": "4"}).threads == 1  # never 0
    assert threads.choose_threads(0, env={"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"}) == \
        threads.ThreadChoice(1, "OMP_NUM_THREADS")  # torchrun's one thread per rank
    assert threads.choose_threads(0, env={"OMP_NUM_THREADS": "junk"}).threads == 3
    assert threads.choose_threads(2, env={"OMP_NUM_THREADS": "1"}) == threads.ThreadChoice(2, "--threads")


def test_oversubscription_is_load_above_the_usable_cores():
    msg = threads.oversubscription_warning(threads=2, cores=2, load=3.4)
    assert msg is not None and "load average is 3.4 on 2 usable cores" in msg and "--threads=1" in msg
    assert threads.oversubscription_warning(threads=2, cores=2, load=2.9) is None  # our own threads count in it
    assert threads.oversubscription_warning(threads=1, cores=4, load=1.0) is None
    one = threads.oversubscription_warning(threads=1, cores=2, load=3.4, env={})
    assert "--threads=1" not in one and "already on 1 thread" in one  # no advice it already follows
    ranks = threads.oversubscription_warning(threads=1, cores=2, load=3.4, env={"LOCAL_WORLD_SIZE": "2"})
    assert "--threads=1" not in ranks and "2 ranks x 1 thread" in ranks  # torchrun's ranks, not threads


def test_a_busy_machine_starts_the_automatic_count_on_one_thread():
    tuner = threads.ThreadTuner(2, start=1)
    assert tuner.threads_for_next_step() == 1 and tuner.choices == (2, 1)
    for _ in range(4):
        tuner.record(1.0, 100.0)
    assert tuner.threads_for_next_step() == 2  # the larger count is measured later


def test_tuner_trains_on_one_thread_while_that_is_faster_and_measures_again_later():
    now = [0.0]
    tuner = threads.ThreadTuner(2, skip=2, probe_steps=3, budget=0.05, min_interval_s=20.0, clock=lambda: now[0])
    speed = {2: 1000.0, 1: 400.0}  # tokens/s of each count: idle cores first

    def steps(n: int) -> list[int]:
        used = []
        for _ in range(n):
            k = tuner.threads_for_next_step()
            used.append(k)
            now[0] += 1000.0 / speed[k]
            tuner.record(1000.0 / speed[k], 1000.0)
        return used
    assert steps(4) == [2, 2, 2, 2]  # 2 skipped, 2 measured
    assert steps(3) == [1, 1, 1] and tuner.current == 2 and not tuner.changes  # one thread tried, slower: kept 2
    assert steps(10) == [2] * 10  # not tried again before the interval (>= 20 s, probe time / budget)
    speed.update({2: 150.0, 1: 450.0})  # two busy processes arrive: 2 spinning threads collapse
    used = steps(40)
    assert used.count(1) >= 3 and tuner.current == 1 and used[-1] == 1
    step, old, new, r_old, r_new = tuner.changes[0]
    assert (old, new) == (2, 1) and r_new == pytest.approx(450.0) and r_old == pytest.approx(150.0)
    speed.update({2: 1000.0, 1: 400.0})  # they leave: a later trial of 2 threads wins it back
    steps(200)
    assert tuner.current == 2 and tuner.changes[-1][1:3] == (1, 2)


def test_wait_policy_words():
    assert threads.wait_policy({}) == "OpenMP threads spin while waiting (libgomp's default)"
    assert threads.wait_policy({"OMP_WAIT_POLICY": "PASSIVE"}) == "OMP_WAIT_POLICY=PASSIVE"


def _layout(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("[layout] "))


def test_trainer_says_its_threads_and_warns_once_when_oversubscribed(tiny_pretrain_run_args, tmp_path, monkeypatch):
    import torch
    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
    monkeypatch.setattr(os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    out = run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=2",
                             "--threads=1"]), env=env).stdout
    assert _layout(out).endswith("; threads 1 (--threads; OMP_WAIT_POLICY=PASSIVE)")
    env.pop("OMP_WAIT_POLICY")
    out2 = run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run2'}", "--max_iters=1"]),
                   env=env).stdout
    assert _layout(out2).endswith("; threads 1 (OMP_NUM_THREADS; OpenMP threads spin while waiting (libgomp's "
                                  "default))")  # torchrun's per-rank 1 is kept, not tuned
    assert 1 in seen
    warnings = [line for line in out.splitlines() if line.startswith("[warning] threads:")]
    assert len(warnings) == 1 and "load average is 9.0" in warnings[0], out


def test_negative_threads_is_a_bad_configuration(tiny_pretrain_run_args, tmp_path):
    proc = run_trainer(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--threads=-1"]))
    assert proc.returncode == 2 and "--threads=-1: must be >= 0" in proc.stderr


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs 2 usable cores and CPU affinity")
def test_a_trainer_without_thread_settings_uses_every_usable_core_and_tunes(tiny_pretrain_run_args, tmp_path):
    """A user's start (no --threads, no OMP_NUM_THREADS): every usable core, tuned against one thread."""
    cores = len(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    out = run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=1"]),
                  env=env).stdout
    assert _layout(out).endswith(f"; threads {cores} ({cores} usable cores, or 1 while that trains faster "
                                 "(measured); OpenMP threads spin while waiting (libgomp's default))")
    det = run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'det'}", "--max_iters=1",
                             "--deterministic=true"]), env=env).stdout
    assert _layout(det).endswith(f"; threads {cores} ({cores} usable cores; OpenMP threads spin while waiting "
                                 "(libgomp's default))")  # a fixed count: the run is reproducible


def test_plan_threads_fixes_what_a_flag_or_the_environment_chose_and_tunes_the_rest():
    idle, busy = {"load": 0.5, "cores": 2}, {"load": 3.5, "cores": 2}
    auto = threads.plan_threads(0, env={}, **idle)
    assert auto.start == 2 and auto.tuner is not None and auto.tuner.current == 2 and auto.warning is None
    crowded = threads.plan_threads(0, env={}, **busy)
    assert crowded.start == 1 and crowded.tuner.current == 1 and crowded.tuner.choices == (2, 1)
    assert "starting on 1 thread" in crowded.warning
    for fixed in (threads.plan_threads(2, env={}, **busy), threads.plan_threads(0, env={"OMP_NUM_THREADS": "2"}, **busy),
                  threads.plan_threads(0, env={}, fixed=True, **busy), threads.plan_threads(0, cpu=False, env={}, **busy)):
        assert fixed.start == 2 and fixed.tuner is None  # a count someone chose (or a GPU run) is kept
        assert "starting on 1 thread" not in fixed.warning and "the 1-minute load average is 3.5" in fixed.warning
    one = threads.plan_threads(0, env={}, load=0.1, cores=1)
    assert one.start == 1 and one.tuner is None  # nothing to choose between
