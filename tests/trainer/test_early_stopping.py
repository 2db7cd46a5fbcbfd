"""--early_stopping_patience / --early_stopping_threshold (trainer/early_stop.py): the count of evaluations without an
improvement, on the loss or (a task without one) the held-out reward; a run that stops early is saved, exits 0, and
has nothing left to train when run again; a larger patience continues it."""
from __future__ import annotations

import json
import os

from tests.conftest import run_trainer, train_cmd
from tests.trainer.test_end_to_end import _env, losses
from utils.constants import EXIT_BAD_CONFIG


def test_the_count_of_evaluations_without_an_improvement():
    from trainer.early_stop import EarlyStopping
    e = EarlyStopping(2, threshold=0.1)
    assert [e.update({"val_loss": v}, s) for s, v in ((1, 3.0), (2, 2.95), (3, 2.8), (4, 2.85), (5, 2.75))] == \
        [False, False, False, False, True]  # 2.95 is not 0.1 below 3.0; 2.8 is; then two that are not
    assert e.best == 2.8 and e.best_step == 3 and "val_loss 2.8000 at step 3" in e.describe()
    again = EarlyStopping(2, 0.1, saved=json.loads(json.dumps(e.state_dict())))  # as a checkpoint keeps it
    assert again.due and again.state_dict() == e.state_dict()
    r = EarlyStopping(1)  # a held-out reward: higher is better
    assert [r.update({"val_reward": v}, s) for s, v in ((1, 0.2), (2, 0.5), (3, 0.5))] == [False, False, True]
    assert r.update({"val_other": 1.0}, 4) and r.stale == 1  # no validation value: nothing counted
    off = EarlyStopping(0)
    assert not any(off.update({"val_loss": 1.0}, s) for s in range(5))


def test_a_run_stops_early_saved_and_a_run_again_has_nothing_left(tiny_pretrain_run_args, tmp_path):
    """A threshold no evaluation can beat: the first evaluation sets the best, the next two do not improve it, so
    patience 2 stops the run at its third evaluation (step 6 of 20), saved; run again, nothing is trained; with
    patience 3 it continues to the next evaluation and stops there."""
    out = tmp_path / "run"
    flags = [*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=20", "--eval_interval=2",
             "--checkpoint_interval=100", "--early_stopping_threshold=100"]
    proc = run_trainer(train_cmd([*flags, "--early_stopping_patience=2"]), env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[train] early stop at step 6: 2 evaluation(s) without an improvement of more than 100 on the best, " \
           "val_loss" in proc.stdout and "at step 2 (--early_stopping_patience=2)" in proc.stdout, proc.stdout[-2000:]
    assert sorted(losses(out)) == list(range(1, 7)) and os.path.isdir(out / "checkpoints" / "step_00000006")
    again = run_trainer(train_cmd([*flags, "--early_stopping_patience=2"]), env=_env())
    assert again.returncode == 0 and "early stop at step 6" in again.stdout and sorted(losses(out)) == list(range(1, 7))
    more = run_trainer(train_cmd([*flags, "--early_stopping_patience=3"]), env=_env())
    assert more.returncode == 0 and "early stop at step 8: 3 evaluation(s)" in more.stdout, more.stdout[-2000:]
    assert sorted(losses(out)) == list(range(1, 9))
    bad = run_trainer(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'bad'}", "--eval_interval=0",
                                 "--early_stopping_patience=2"]), env=_env())
    assert bad.returncode == EXIT_BAD_CONFIG and "--early_stopping_patience=2 counts evaluations: it needs " \
        "--eval_interval > 0" in bad.stderr, bad.stderr[-1000:]
