"""--eval_tasks (issue 37 item 10): multiple-choice task files scored at every evaluation of a training run, as
eval_lm.py scores a checkpoint: the logged accuracies equal lm_tasks' on the saved weights of that step."""
from __future__ import annotations

import json
import os


import train_my_ddp as T
from utils.constants import EXIT_BAD_CONFIG, EXIT_BAD_DATA
from utils.metrics import read_metrics


def _task(path, n=6):
    recs = [{"context": f"The number {i} is", "choices": [" small", " large", " odd"], "label": i % 3} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_eval_tasks_are_logged_and_equal_the_checkpoints_scores(tiny_pretrain_run_args, tiny_pretrain_data, tmp_path,
                                                                 capsys):
    import torch

    from evals.lm_tasks import TaskEvaluator
    from model import Transformer
    from model.config import read_model_config
    from checkpoint.weights import checkpoint_model_state
    from checkpoint.verify import find_latest_valid
    task = _task(tmp_path / "numbers.jsonl")
    out = tmp_path / "run"
    assert T.main([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=3", f"--eval_tasks={task}",
                   "--eval_tasks_limit=5"]) == 0
    assert "[eval_tasks] step 3: numbers_acc" in capsys.readouterr().out
    row = [r for r in read_metrics(str(out / "metrics.jsonl")) if r.get("step") == 3 and "val_numbers_acc" in r][-1]
    ckpt_dir = find_latest_valid(str(out), log=lambda m: None)
    model = Transformer(read_model_config(ckpt_dir))
    model.load_state_dict(checkpoint_model_state(ckpt_dir))
    ev = TaskEvaluator([str(task)], tiny_pretrain_data["tokenizer_dir"], tiny_pretrain_data["max_seq_len"], limit=5)
    want = ev.run(model, torch.device("cpu"))
    assert row["val_numbers_acc"] == want["val_numbers_acc"] and row["val_numbers_acc_norm"] == want["val_numbers_acc_norm"]
    assert len(ev.tasks["numbers"][1]) == 5


def test_bad_eval_task_files_are_one_line(tiny_pretrain_run_args, tmp_path, capsys):
    base = [*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'r'}", "--max_iters=1"]
    assert T.main([*base, f"--eval_tasks={tmp_path / 'nope.jsonl'}"]) == EXIT_BAD_CONFIG
    assert "--eval_tasks: " in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": [" b"], "label": 0}\n{"prompt": "x"}\n')
    assert T.main([*base, f"--eval_tasks={bad}"]) == EXIT_BAD_DATA
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(err) == 1 and f"{bad}:2: fits no multiple-choice format" in err[0], err
    assert T.main([*base, f"--eval_tasks={_task(tmp_path / 't.jsonl')}", "--parallel=fsdp"]) == EXIT_BAD_CONFIG
    assert "--eval_tasks cannot be combined with --parallel=fsdp" in capsys.readouterr().err


def _bad_task(tmp_path, name):
    """(path, exit code, what the line says) of one --eval_tasks file the pre-check refuses."""
    f = tmp_path / "t.jsonl"
    good = json.dumps({"context": "a", "choices": [" b", " c"], "label": 0}) + "\n"
    rec = {"choice_number": {"context": "a", "choices": [" b", 5], "label": 0},
           "context_list": {"context": ["a"], "choices": [" b", " c"], "label": 0},
           "empty_choice": {"context": "a", "choices": ["", " c"], "label": 1},
           "label_half": {"context": "a", "choices": [" b", " c"], "label": 0.5}}
    says = {"choice_number": "choices[1] is a number 5, not a string", "context_list": "context is a list, not a string",
            "empty_choice": "choices[0] is an empty string", "label_half": "label is a number 0.5, not an integer"}
    if name == "invalid_utf8":
        f.write_bytes(good.encode() + b"\xff\xfe\n")
        return f, EXIT_BAD_DATA, f"data: {f}:2: invalid UTF-8 (byte 1 of the line)"
    if name == "directory":
        f.mkdir()
        return f, EXIT_BAD_CONFIG, f"bad configuration: --eval_tasks: {f}: is a directory"
    if name == "empty":
        f.write_text("")
        return f, EXIT_BAD_DATA, f"data: {f}: no records (an empty task file)"
    f.write_text(good + json.dumps(rec[name]) + "\n")
    return f, EXIT_BAD_DATA, f"data: {f}:2: {says[name]}"


def test_bad_eval_task_files_are_refused_by_the_pre_check_without_torch(tiny_pretrain_run_args, tmp_path, capsys):
    """The pre-check (trainer/precheck.py, before torch) reads every record: a file that would crash the first
    evaluation (and the supervisor's restarts into it) or score a silent wrong result ends the start with one line
    and a code monitor_process.py never retries; the run directory is never made."""
    import pytest

    from tests.conftest import ROOT
    from tests.utils.test_cli import _run_without_torch
    from trainer.precheck import precheck
    trainer = os.path.join(ROOT, "train_my_ddp.py")
    (tmp_path / "sub").mkdir()
    f, code, says = _bad_task(tmp_path / "sub", "invalid_utf8")
    out = tmp_path / "run_utf8"
    with capsys.disabled():
        got, _, err, _ = _run_without_torch([trainer, *tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=1",
                                             f"--eval_tasks={f}"], "train_my_ddp.py [eval_tasks invalid UTF-8]")
    assert (got, err.strip()) == (code, f"[rank 0] error: {says}") and not out.exists()
    for name in ("directory", "empty", "choice_number", "context_list", "empty_choice", "label_half"):
        d = tmp_path / name
        d.mkdir()
        f, code, says = _bad_task(d, name)
        with pytest.raises(SystemExit) as e:
            precheck([*tiny_pretrain_run_args, f"--out_dir={d / 'run'}", "--max_iters=1", f"--eval_tasks={f}"],
                     title="t", prog="train_my_ddp.py")
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert e.value.code == code and len(err) == 1 and err[0].startswith(f"[rank 0] error: {says}"), (name, err)
        assert not (d / "run").exists(), name


def test_a_bad_eval_task_file_stops_the_full_path_before_any_step(tiny_pretrain_run_args, tmp_path, capsys):
    """Without the pre-check (T.main, as under torchrun's ranks), the same line and code when the trainer starts:
    no step trained, no checkpoint (a number among the choices used to pass the start and crash the first
    evaluation)."""
    f, code, says = _bad_task(tmp_path, "choice_number")
    out = tmp_path / "run"
    assert T.main([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=3", f"--eval_tasks={f}"]) == code
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert err == [f"[rank 0] error: {says}"], err
    assert not (out / "checkpoints").exists() or not os.listdir(out / "checkpoints")
