"""utils.run_config: a resume starts from the run's saved configuration, the command line wins and is
listed, changes that break exactness are refused by name; choosing latest / best / step_N."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from trainer import config as T
from utils.configurator import ConfigError
from checkpoint.plain import SaveRequest, save_checkpoint
from utils.errors import CheckpointError
from utils.run_config import global_batch_problem
from checkpoint.select import resolve_resume_config, select_checkpoint
from checkpoint.verify import list_checkpoints, prune_checkpoints, selection_score


def _run_dir(tmp_path, **over):
    saved = dataclasses.asdict(T.TrainConfig())
    saved.update(dict(out_dir=str(tmp_path), data_dir="d", tokenizer_dir="t", learning_rate=3e-3, min_lr=3e-4,
                      max_seq_len=64, dim=32, n_layers=2, init_from="scratch"), **over)
    (tmp_path / "config.json").write_text(json.dumps(saved))
    return saved


def test_resume_takes_the_saved_run_and_lists_overrides(tmp_path):
    _run_dir(tmp_path)
    said = []
    cfg, src = resolve_resume_config(T.TrainConfig(), [f"--out_dir={tmp_path}", "--init_from=resume",
                                                       "--max_iters=50"], str(tmp_path), log=said.append)
    assert src == str(tmp_path / "config.json")
    # the run's schedule, not the defaults (6e-4), and no StaleIndexError for a forgotten --max_seq_len
    assert (cfg.learning_rate, cfg.min_lr, cfg.max_seq_len, cfg.dim) == (3e-3, 3e-4, 64, 32)
    assert cfg.init_from == "resume" and cfg.max_iters == 50
    assert len(said) == 1 and "max_iters 1000 -> 50" in said[0] and "learning_rate" not in said[0]


@pytest.mark.parametrize("flag", ["--dim=64", "--max_seq_len=128", "--data_dir=other", "--seed=1", "--n_layers=3",
                                  "--lora_alpha=32"])
def test_resume_refuses_changes_that_break_exactness(tmp_path, flag):
    _run_dir(tmp_path)
    with pytest.raises(ConfigError) as e:
        resolve_resume_config(T.TrainConfig(), ["--init_from=resume", flag], str(tmp_path), log=lambda s: None)
    assert flag.split("=")[0] in str(e.value)


def test_same_directory_spelled_otherwise_is_not_a_data_change(tmp_path, monkeypatch):
    """`--data_dir=d/`, `d`, `./d` and its absolute path name the same data (resolved in the working directory)."""
    monkeypatch.chdir(tmp_path)
    _run_dir(tmp_path)
    for spelling in ("d/", "./d", str(tmp_path / "d"), str(tmp_path / "d") + "/"):
        said = []
        cfg, _ = resolve_resume_config(T.TrainConfig(), ["--init_from=resume", f"--data_dir={spelling}",
                                                         "--tokenizer_dir=./t/"], str(tmp_path), log=said.append)
        assert "nothing changed" in said[0], (spelling, said)
        from utils.run_config import same_value
        assert same_value("data_dir", "d", cfg.data_dir)
    with pytest.raises(ConfigError, match="--data_dir"):
        resolve_resume_config(T.TrainConfig(), ["--init_from=resume", "--data_dir=d2"], str(tmp_path), log=print)


def test_resume_allows_data_change_when_asked(tmp_path):
    _run_dir(tmp_path)
    cfg, _ = resolve_resume_config(T.TrainConfig(), ["--init_from=resume", "--data_dir=other",
                                                     "--allow_data_change=true"], str(tmp_path), log=lambda s: None)
    assert cfg.data_dir == "other"


def test_resume_without_a_saved_config_is_the_command_line(tmp_path):
    cfg, src = resolve_resume_config(T.TrainConfig(), ["--init_from=resume", "--dim=48"], str(tmp_path),
                                     log=lambda s: None)
    assert src is None and cfg.dim == 48


def test_saved_values_are_type_checked_as_data(tmp_path):
    _run_dir(tmp_path, dim="not a number")
    with pytest.raises(ConfigError, match="dim"):
        resolve_resume_config(T.TrainConfig(), ["--init_from=resume"], str(tmp_path), log=lambda s: None)


def test_global_batch_must_stay_equal():
    saved = {"batch_size": 8, "gradient_accumulation_steps": 2, "world_size": 1}
    assert global_batch_problem(saved, 4, 2, 1, 2) is None            # half the batch on twice the ranks
    msg = global_batch_problem(saved, 8, 2, 1, 2)
    assert msg and "16 samples per step" in msg and "32" in msg


def _save(out_dir, step, val_loss, **state):
    req = SaveRequest(step=step, rank=0, world_size=1, model_state={"w": torch.full((2,), float(step))},
                      model_config={"dim": 2}, optimizer_state=None, extra_state={},
                      trainer_state={"val_loss": val_loss, **state}, run_config={})
    return save_checkpoint(str(out_dir), req, keep_last=10, log=lambda s: None)


def test_best_of_a_run_without_a_validation_loss_is_the_highest_validation_reward(tmp_path):
    """GRPO's evaluation is a held-out reward (higher is better), saved beside a val_loss of None."""
    run, other = tmp_path / "run", tmp_path / "other"
    _, p2, _ = (_save(run, 1, None, val_reward=0.25), _save(run, 2, None, val_reward=0.75),
                _save(run, 3, None, val_reward=0.5))
    _save(run, 4, None)  # saved without an evaluation
    lines = []
    assert select_checkpoint(str(run), "best", log=lines.append) == p2
    assert lines == [f"[checkpoint] best: {p2} (val_reward 0.7500)"]
    prune_checkpoints(str(run), keep_last=1, keep_best=True, log=lambda s: None)
    assert [s for s, _ in list_checkpoints(str(run))] == [4, 2]  # the newest, and the best by reward
    assert selection_score({"val_loss": 2.0, "val_reward": 0.9}) == (2.0, "val_loss 2.0000")  # a loss decides
    assert selection_score({"val_loss": None, "val_reward": True}) is None  # not a number
    _save(other, 1, None)
    with pytest.raises(CheckpointError, match="no valid checkpoint has a validation loss or reward"):
        select_checkpoint(str(other), "best")


def test_select_checkpoint_latest_best_and_step(tmp_path):
    p10, p20, p30 = _save(tmp_path, 10, 2.0), _save(tmp_path, 20, 1.5), _save(tmp_path, 30, None)
    assert select_checkpoint(str(tmp_path), "latest") == p30
    assert select_checkpoint(str(tmp_path), "best", log=lambda s: None) == p20
    assert select_checkpoint(str(tmp_path), "step_10") == p10
    assert select_checkpoint(str(tmp_path), "20") == p20
    assert select_checkpoint(p10) == p10
    with pytest.raises(CheckpointError, match="no checkpoint at step 15.*step_00000010"):
        select_checkpoint(str(tmp_path), "step_15")
    with pytest.raises(CheckpointError, match="latest, best or step_N"):
        select_checkpoint(str(tmp_path), "newest")
    # a damaged best is never chosen
    with open(os.path.join(p20, "model.safetensors"), "r+b") as f:
        f.truncate(8)
    assert select_checkpoint(str(tmp_path), "best", log=lambda s: None) == p10
    with pytest.raises(CheckpointError, match="not usable"):
        select_checkpoint(str(tmp_path), "step_20")
