"""Issue 37 item 5: the trainer's remaining mistakes answered before torch is imported (trainer/precheck.py):
a --data_dir that does not exist (said so, exit 3), a --data_dir of raw .jsonl (the pretokenizer's commands,
exit 3), --dim=250 --n_heads=8 (exit 2); and a start that fails in set-up leaves no run_start.json, so the next
start is a new run, not "[resume] ... starting as the run did"."""
import os
import shutil

from tests.conftest import ROOT, run_trainer, train_cmd
from tests.utils.test_cli import _run_without_torch
from utils.constants import EXIT_BAD_CONFIG, EXIT_BAD_DATA

TRAINER = os.path.join(ROOT, "train_my_ddp.py")


def _with(args, **flags):
    out = [a for a in args if a.split("=", 1)[0].lstrip("-") not in flags]
    return out + [f"--{k}={v}" for k, v in flags.items()]


def test_data_dir_and_head_mistakes_are_answered_before_torch(tiny_pretrain_run_args, tmp_path, capsys):
    import train_my_ddp as T
    raw = tmp_path / "raw"
    raw.mkdir()
    shutil.copy(os.path.join(ROOT, "data", "pretrain", "zh_written.jsonl"), raw / "zh.jsonl")
    tok = next(a.split("=", 1)[1] for a in tiny_pretrain_run_args if a.startswith("--tokenizer_dir="))
    shards = next(a.split("=", 1)[1] for a in tiny_pretrain_run_args if a.startswith("--data_dir="))
    cases = {
        "missing": (_with(tiny_pretrain_run_args, data_dir=tmp_path / "nope"), EXIT_BAD_DATA,
                    f"[rank 0] error: data: {tmp_path / 'nope'}: not a directory of token shards: it does not exist"),
        "raw_jsonl": (_with(tiny_pretrain_run_args, data_dir=raw), EXIT_BAD_DATA,
                      f"[rank 0] error: data: {raw}: no token shards, but 1 raw text file(s) (zh.jsonl); pretokenize "
                      f"them first: python -m data_preprocess.pretokenize_pretrain_data --data_dir {raw / 'zh.jsonl'} "
                      f"--tokenizer_dir={tok} --out_dir=out/pretrain_tokenized/raw; python -m "
                      f"data_preprocess.build_pretrain_sample_index_map --data_dir=out/pretrain_tokenized/raw "
                      f"--max_seq_len=32; then train with --data_dir=out/pretrain_tokenized/raw"),
        "no_index": (_with(tiny_pretrain_run_args, max_seq_len=48), EXIT_BAD_DATA,
                     f"[rank 0] error: data: {shards}/index_L48/index_meta.json: no index for max_seq_len=48 (found "
                     "['index_L32']; build one with build_pretrain_sample_index_map --max_seq_len=48)"),
        "heads": (_with(tiny_pretrain_run_args, dim=250, n_heads=8), EXIT_BAD_CONFIG,
                  "[rank 0] error: bad model configuration: dim=250 is not divisible by n_heads=8"),
    }
    for name, (argv, want_code, want_line) in cases.items():
        out = tmp_path / f"run_{name}"
        with capsys.disabled():
            code, _, err, _ = _run_without_torch([TRAINER, *map(str, argv), f"--out_dir={out}", "--max_iters=1"],
                                                 f"train_my_ddp.py [{name}]")
        assert code == want_code and err.strip() == want_line, (name, code, err)
        assert not out.exists(), name  # refused before the run directory was made
    # the full path (torch imported) says the first and the last the same way
    for name in ("missing", "no_index", "heads"):
        argv, want_code, want_line = cases[name]
        assert T.main([*map(str, argv), f"--out_dir={tmp_path / 'full'}", "--max_iters=1"]) == want_code
        assert want_line in capsys.readouterr().err


def test_a_start_that_fails_in_set_up_leaves_no_run_start(tiny_pretrain_run_args, tmp_path):
    """--max_seq_len=16 has no index: refused when the data is built, after the model (exit 3). It used to
    leave run_start.json, and the next, correct start printed '[resume] no checkpoint in ... yet: starting as
    the run did'."""
    out = tmp_path / "run"
    failed = run_trainer(train_cmd(_with(tiny_pretrain_run_args, out_dir=out, max_iters=1, max_seq_len=16)))
    assert failed.returncode == EXIT_BAD_DATA and "no index for max_seq_len=16" in failed.stderr, failed.stderr[-2000:]
    assert not (out / "run_start.json").exists() and not (out / "config.json").exists()
    ok = run_trainer(train_cmd(_with(tiny_pretrain_run_args, out_dir=out, max_iters=1)))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert f"[init] new run from scratch in {out}" in ok.stdout and "[resume]" not in ok.stdout, ok.stdout[-2000:]
    assert (out / "run_start.json").exists()  # a start that trained is recorded
