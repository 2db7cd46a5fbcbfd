"""--eval_tasks (issue 37 item 10): multiple-choice task files scored at every evaluation of a training run, as
eval_lm.py scores a checkpoint: the logged accuracies equal lm_tasks' on the saved weights of that step."""
from __future__ import annotations

import json


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
    from parallel.checkpoint_io import checkpoint_model_state
    from utils.checkpoint import find_latest_valid
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
