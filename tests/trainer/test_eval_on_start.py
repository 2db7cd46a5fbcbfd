"""--eval_on_start (HF Trainer's eval_on_start): a new run's step-0 row holds the validation of its starting weights,
and nothing else of the run changes."""
from __future__ import annotations

import os

import pytest

from tests.conftest import run_cmd, train_cmd
from utils.metrics import read_metrics


def _rows(out) -> list[dict]:
    return read_metrics(os.path.join(out, "metrics.jsonl"))


def test_the_step_0_row_is_the_starting_weights_validation(tiny_pretrain_run_args, tmp_path):
    """A run X evaluates at steps 0 and 2; a new run Y from X's step-2 weights (same data, same validation batches)
    has, as its step-0 row, X's step-2 validation loss exactly: the row is the starting weights' evaluation. X trains
    the losses of a run without the flag (the evaluation draws nothing from the training's generators), and X
    continued to step 4 writes no second step-0 row."""
    args = [*tiny_pretrain_run_args, "--eval_interval=2", "--checkpoint_interval=2"]
    x, y, plain = tmp_path / "x", tmp_path / "y", tmp_path / "plain"
    log = run_cmd(train_cmd([*args, f"--out_dir={x}", "--max_iters=2", "--eval_on_start=true"])).stdout
    assert "[eval] step 0 (--eval_on_start): val_loss " in log, log[-2000:]
    run_cmd(train_cmd([*args, f"--out_dir={plain}", "--max_iters=2"]))
    run_cmd(train_cmd([*args, f"--out_dir={y}", "--max_iters=1", "--eval_on_start=true", f"--init_from={x}"]))
    rx, ry, rp = _rows(x), _rows(y), _rows(plain)
    assert rx[0]["step"] == 0 and "loss" not in rx[0] and rx[0]["val_loss"] > 0
    x_step2 = [r for r in rx if r["step"] == 2 and "val_loss" in r][-1]["val_loss"]
    assert ry[0]["step"] == 0 and ry[0]["val_loss"] == x_step2
    assert [r["loss"] for r in rx if "loss" in r] == [r["loss"] for r in rp if "loss" in r]
    assert rx[0]["val_loss"] != x_step2  # (two steps at this learning rate move the validation loss)
    run_cmd(train_cmd([*args, f"--out_dir={x}", "--max_iters=4", "--eval_on_start=true"]))
    assert [r["step"] for r in _rows(x)].count(0) == 1


def test_without_evaluations_it_is_refused():
    from trainer.config import TrainConfig
    from trainer.validation import validate_config
    with pytest.raises(Exception, match=r"--eval_on_start=true needs --eval_interval > 0"):
        validate_config(TrainConfig(data_dir="d", tokenizer_dir="t", device="cpu", eval_on_start=True,
                                    eval_interval=0), torch_free=True)
