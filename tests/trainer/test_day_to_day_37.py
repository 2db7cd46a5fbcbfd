"""Issue 37 items 6, 8, 9: --tensorboard=true without tensorboard is refused (exit 2); the warmup can be a
fraction of the run and short SFT/DPO runs get one they can finish; --help of the commands shows defaults;
--tensor_parallel_size > 1 implies --parallel=fsdp."""
from __future__ import annotations

import importlib.util
import os

import pytest

from tests.conftest import PY, child_env, run_cmd, run_python, run_trainer, train_cmd
from trainer.config import TrainConfig, TrainingError, imply_engine, resolve_warmup
from trainer.validation import validate_config
from utils.lr_schedule import lr_at


_env = child_env  # tests/conftest.py: one thread per process, unbuffered output


def test_tensorboard_without_the_package_is_refused(monkeypatch):
    cfg = TrainConfig(data_dir="d", tokenizer_dir="t", tensorboard=True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else object())
    with pytest.raises(TrainingError) as e:
        validate_config(cfg, torch_free=True)
    assert e.value.code == 2 and "--tensorboard=true needs the tensorboard package" in str(e.value)


def test_tensorboard_run_without_the_package_exits_2_before_training(tiny_pretrain_run_args, tmp_path, monkeypatch,
                                                                     capsys):
    """The whole start (the package hidden from this process: the test venv has it), not only validate_config."""
    import train_my_ddp as T
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    code = T.main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=2", "--tensorboard=true"])
    err = capsys.readouterr().err
    assert code == 2 and "pip install tensorboard" in err
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_warmup_defaults_per_task_and_ratio():
    assert resolve_warmup(-1, 0.0, 1000, "pretrain")[0] == 100
    assert resolve_warmup(-1, 0.0, 50, "pretrain")[0] == 5     # was 100: a 50-step run never peaked
    assert resolve_warmup(-1, 0.0, 200, "sft")[0] == 6         # 3% of the run
    assert resolve_warmup(-1, 0.0, 20, "dpo")[0] == 1
    assert resolve_warmup(-1, 0.1, 200, "sft") == (20, "--warmup_ratio=0.1 x 200 steps")
    assert resolve_warmup(7, 0.1, 200, "sft")[0] == 7           # explicit steps win, as in HF Trainer
    bad = TrainConfig(data_dir="d", tokenizer_dir="t", warmup_ratio=1.5, warmup_iters=-2)
    with pytest.raises(TrainingError) as e:
        validate_config(bad, torch_free=True)
    assert "--warmup_ratio=1.5: must be in [0, 1)" in str(e.value) and "--warmup_iters=-2" in str(e.value)


def test_warmup_ratio_sets_the_runs_schedule(tiny_pretrain_run_args, tmp_path):
    from utils.metrics import dedupe_by_step, read_metrics
    args = [a for a in tiny_pretrain_run_args if not a.startswith("--warmup_iters")]
    out = tmp_path / "run"
    log = run_cmd(train_cmd([*args, f"--out_dir={out}", "--max_iters=4", "--warmup_ratio=0.5"]), env=_env()).stdout
    assert "[schedule] warmup 2 steps (--warmup_ratio=0.5 x 4 steps)" in log
    recs = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    want = [lr_at(s, max_lr=1e-2, min_lr=6e-5, warmup_iters=2, decay_iters=4, schedule="cosine") for s in range(4)]
    assert [recs[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx(want)
    assert '"warmup_iters": 2' in (out / "config.json").read_text()  # saved resolved: a resume keeps it


@pytest.mark.parametrize("command", [["sample.py"], ["monitor_process.py"], ["-m", "tokenizer.train_tokenizer"]])
def test_help_shows_defaults(command):
    proc = run_python([PY, *command, "--help"])
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    want = {"sample.py": "0 = greedy (default: 0.8)", "monitor_process.py": "seconds before the first restart (default: 5.0)",
            "-m": "(default: hf_bbpe)"}[command[0]]
    assert want in text, proc.stdout


def test_tensor_parallel_alone_implies_fsdp():
    cfg = TrainConfig(tensor_parallel_size=2)
    assert imply_engine(cfg, given={"tensor_parallel_size"}).startswith("[layout] --tensor_parallel_size=2 runs on")
    assert cfg.parallel == "fsdp"
    explicit = TrainConfig(tensor_parallel_size=2, parallel="ddp")
    assert imply_engine(explicit, given={"tensor_parallel_size", "parallel"}) is None and explicit.parallel == "ddp"
    assert imply_engine(TrainConfig(), given=set()) is None


def test_tensor_parallel_run_without_parallel_flag_trains_on_fsdp(tiny_pretrain_run_args, tmp_path):
    proc = run_trainer(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=1",
                                  "--tensor_parallel_size=2"], nproc=2), env=_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--parallel=fsdp chosen" in proc.stdout and "engine fsdp (FSDP2" in proc.stdout


def test_tasks_that_start_from_trained_weights_refuse_scratch_by_their_registration(monkeypatch):
    """SFT and DPO are registered from_pretrained (trainer/tasks/__init__.py): --init_from=scratch is one exit-2
    line naming the task, as is --resume_fallback=scratch; pretraining and GRPO start anywhere. A task registered
    with the flag gets the same refusal without a test of its name."""
    import pytest
    from trainer import tasks
    base = dict(data_dir="d", tokenizer_dir="t", init_from="scratch")
    for task in ("sft", "dpo"):
        with pytest.raises(TrainingError) as e:
            validate_config(TrainConfig(task_type=task, **base))
        assert f"--task_type={task} starts from pretrained weights: pass --init_from=<run dir>" in str(e.value)
        with pytest.raises(TrainingError) as e:
            validate_config(TrainConfig(task_type=task, data_dir="d", tokenizer_dir="t", resume="always",
                                        resume_fallback="scratch"))
        assert "--resume_fallback=scratch cannot be used" in str(e.value)
    validate_config(TrainConfig(task_type="pretrain", **base))
    monkeypatch.setitem(tasks.TASKS, "pretrain", tasks.TaskEntry("trainer.tasks.pretrain:PretrainTask",
                                                                 from_pretrained=True))
    with pytest.raises(TrainingError, match="--task_type=pretrain starts from pretrained weights"):
        validate_config(TrainConfig(task_type="pretrain", **base))
