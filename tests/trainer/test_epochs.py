"""--num_train_epochs: max_iters from the training set's size and the global batch (trainer.config.max_iters_for_epochs),
an explicit --max_iters wins (also for a resume that does not repeat it), the LR decay follows the derived length,
and a resumed run computes the same max_iters (no changed flag, no schedule warning, the same losses)."""
from __future__ import annotations

import json
import math
import os

import pytest

import train_my_ddp as T
from utils.configurator import parse_config
from trainer.config import TrainConfig, max_iters_for_epochs
from utils.lr_schedule import lr_at
from utils.metrics import dedupe_by_step, read_metrics

GLOBAL_BATCH = ["--batch_size=4", "--gradient_accumulation_steps=2"]  # 8 samples per optimizer step
EPOCHS = 0.01  # of the tiny corpus: a few steps


def test_max_iters_for_epochs():
    steps, line = max_iters_for_epochs(2.5, 2600, 64, 1000, max_iters_given=False)
    assert steps == 100  # 2600 // 64 = 40 steps per epoch (the 40 left-over samples are dropped)
    assert line == ("[schedule] --num_train_epochs=2.5: 1 epoch = 40 steps of 64 samples (2600 training samples) "
                    "-> max_iters=100")
    assert max_iters_for_epochs(0.5, 41 * 16, 16, 1000, False)[0] == 21  # 20.5 steps: the part step counts
    assert max_iters_for_epochs(0.1, 30 * 8, 8, 1000, False)[0] == 3  # 0.1 x 30 = 3.0000000000000004: not 4
    assert max_iters_for_epochs(0.001, 100, 10, 1000, False)[0] == 1  # never 0 steps
    steps, line = max_iters_for_epochs(2.5, 2600, 64, 7, max_iters_given=True)
    assert steps == 7 and line.endswith("-> 100 steps, but --max_iters=7 was given and wins")
    # GRPO's --num_iterations=3: each batch of prompts trains 3 steps, an epoch is 3 x 40 steps
    steps, line = max_iters_for_epochs(2.5, 2600, 64, 1000, max_iters_given=False, steps_per_draw=3)
    assert (steps, line) == (300, "[schedule] --num_train_epochs=2.5: 1 epoch = 120 steps of 64 samples, each trained "
                                  "on for 3 steps (2600 training samples) -> max_iters=300")


def test_an_epoch_is_the_same_for_any_split_of_the_global_batch():
    """What a resume at another number of processes sees: the loader of every layout with the same global
    batch has the same (samples, samples per step), hence the same max_iters."""
    from dataset.loader import ResumableLoader
    data = list(range(1000))
    layouts = [(16, 1, 1, 0), (8, 2, 1, 0), (4, 2, 2, 1), (2, 2, 4, 3)]  # (batch, accumulation, dp ranks, rank)
    got = set()
    for batch, accum, world, rank in layouts:
        loader = ResumableLoader(data, batch, seed=1, rank=rank, world_size=world,
                                 samples_per_step=batch * accum * world)
        got.add(max_iters_for_epochs(1.5, loader.num_samples, loader.samples_per_step, 1000, False))
    assert got == {(93, "[schedule] --num_train_epochs=1.5: 1 epoch = 62 steps of 16 samples (1000 training samples) "
                        "-> max_iters=93")}


def test_which_flags_a_command_gives(tmp_path):
    """parse_config(given=...) records explicit settings, aliases and config files included, never defaults."""
    for argv, explicit in ((["--num_train_epochs=2"], False), (["--max_iters=5"], True), (["--max_steps=5"], True),
                           (["--max_iters=1000"], True)):
        given: set[str] = set()
        parse_config(TrainConfig(), argv, given=given)
        assert ("max_iters" in given) is explicit, argv
    (tmp_path / "c.json").write_text(json.dumps({"max_iters": 9}))
    given = set()
    assert parse_config(TrainConfig(), [str(tmp_path / "c.json"), "--lr=1e-3"], given=given).max_iters == 9
    assert given == {"max_iters", "learning_rate"}


def _steps(out) -> dict[int, dict]:
    return dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))


@pytest.fixture(scope="module")
def per_epoch(tiny_pretrain_data) -> int:
    from dataset import PretokDatasetWithIndex
    n = len(PretokDatasetWithIndex(tiny_pretrain_data["data_dir"], tiny_pretrain_data["max_seq_len"], split="train"))
    assert n // 8 >= 400, n
    return n // 8


def test_epochs_set_max_iters_and_the_lr_decay_and_resume_the_same(tiny_pretrain_run_args, per_epoch, tmp_path,
                                                                    capsys, monkeypatch):
    args = [*tiny_pretrain_run_args, *GLOBAL_BATCH, f"--num_train_epochs={EPOCHS}", "--lr_schedule=linear",
            "--min_lr=1e-4"]
    want = math.ceil(EPOCHS * per_epoch)
    assert want >= 4  # the crash below is at step 4, after the step-3 checkpoint
    ref = tmp_path / "ref"
    assert T.main([*args, f"--out_dir={ref}"]) == 0
    log = capsys.readouterr().out
    assert (f"[schedule] --num_train_epochs={EPOCHS}: 1 epoch = {per_epoch} steps of 8 samples" in log
            and f"-> max_iters={want}\n" in log), log[-3000:]
    recs = _steps(ref)
    assert sorted(recs) == list(range(1, want + 1))
    assert json.loads((ref / "config.json").read_text())["max_iters"] == want
    # the decay spans the derived length (lr_decay_iters=0 follows max_iters): the last step is one linear
    # decrement above min_lr, not the start of a 1000-step decay
    for s, r in recs.items():
        assert r["lr"] == lr_at(s - 1, max_lr=1e-2, min_lr=1e-4, warmup_iters=2, decay_iters=want, schedule="linear")

    # crash at step 4 (the step-3 checkpoint kept), then the same command again: the same max_iters
    crashed = tmp_path / "crashed"
    monkeypatch.setenv("MYLLM_FAULT", "nan_loss@4")
    assert T.main([*args, f"--out_dir={crashed}"]) == 4
    monkeypatch.delenv("MYLLM_FAULT")
    capsys.readouterr()
    assert T.main([*args, f"--out_dir={crashed}"]) == 0
    log = capsys.readouterr().out
    assert "(nothing changed on the command line)" in log and f"-> max_iters={want}\n" in log, log[-3000:]
    assert "[warning] schedule" not in log
    assert {s: r["loss"] for s, r in _steps(crashed).items()} == {s: r["loss"] for s, r in recs.items()}


def test_explicit_max_iters_wins_also_when_the_resume_does_not_repeat_it(tiny_pretrain_run_args, per_epoch, tmp_path,
                                                                         capsys):
    out = tmp_path / "run"
    args = [*tiny_pretrain_run_args, *GLOBAL_BATCH, f"--num_train_epochs={EPOCHS}", f"--out_dir={out}"]
    assert T.main([*args, "--max_iters=2"]) == 0
    log = capsys.readouterr().out
    assert f"-> {math.ceil(EPOCHS * per_epoch)} steps, but --max_iters=2 was given and wins" in log
    assert sorted(_steps(out)) == [1, 2]
    # the resume reads max_iters=2 from the saved configuration and is not told it was explicit: the
    # checkpoint says so (trainer_state.json max_iters_from), so the run is finished, not extended to the epochs
    assert T.main(args) == 0
    log = capsys.readouterr().out
    assert "but --max_iters=2 was given and wins" in log and "done: 2 steps" in log, log[-2000:]
    assert sorted(_steps(out)) == [1, 2]
