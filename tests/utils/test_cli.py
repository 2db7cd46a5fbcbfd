"""utils.cli: one convention for flags across commands (booleans, --out_dir, aliases, hints)."""
from __future__ import annotations

import pytest

from utils.cli import Parser, add_bool, add_out_dir, unknown_flag_message


def _parser():
    p = Parser(prog="x")
    add_out_dir(p, "where to write", required=True)
    add_bool(p, "progress", True, "progress bars", false_aliases=("quiet",))
    return p


@pytest.mark.parametrize("argv,progress", [([], True), (["--progress=false"], False), (["--progress"], True),
                                           (["--no_progress"], False), (["--quiet"], False),
                                           (["--progress=no"], False), (["--progress=1"], True)])
def test_booleans_have_one_spelling_and_aliases(argv, progress):
    ns = _parser().parse_args(["--out_dir=o", *argv])
    assert ns.progress is progress and ns.out_dir == "o"


def test_output_dir_and_dashes_are_aliases():
    assert _parser().parse_args(["--output_dir=o"]).out_dir == "o"
    assert _parser().parse_args(["--out-dir=o"]).out_dir == "o"


def test_unknown_flags_get_a_hint(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["--out_dir=o", "--progres=false"])
    assert e.value.code == 2
    assert "did you mean --progress" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["--out=o"])  # no prefix guessing
    assert unknown_flag_message("--max_steps=5", {"max_iters"}, {}) == "unknown flag --max_steps: did you mean --max_iters?"
    assert "--dtype=bf16" in unknown_flag_message("--bf16", {"dtype"}, {})
    # --num_train_epochs is a trainer flag (trainer.config.max_iters_for_epochs), not a hint any more; a
    # misspelling of it is pointed at it
    from utils.cli import TRAIN_HINTS
    assert "num_train_epochs" not in TRAIN_HINTS
    assert unknown_flag_message("--num_train_epoch=3", {"num_train_epochs", "max_iters"}, {}) == \
        "unknown flag --num_train_epoch: did you mean --num_train_epochs?"


def test_commands_share_the_convention(tmp_path):
    """The tokenizer and preprocessing commands take --out_dir (and --output_dir), bool spellings."""
    from data_preprocess.chat_tokens import SFT
    from data_preprocess.pretokenize_sft_data import default_out_dir
    from tokenizer.train_tokenizer import build_arg_parser
    p = build_arg_parser()
    a = p.parse_args(["--data_dir=d", "--out_dir=o", "--vocab_size=300", "--quiet", "--no_recursive"])
    assert (a.out_dir, a.progress, a.recursive, a.verbose, a.overwrite) == ("o", False, False, False, False)
    b = p.parse_args(["--data_dir=d", "--output_dir=o", "--vocab_size=300", "--progress=false", "--overwrite=true"])
    assert (b.out_dir, b.progress, b.overwrite) == ("o", False, True)
    # the SFT default output is a named folder under out/, not a sibling of the raw data
    assert default_out_dir(SFT, "data/sft", 512) == "out/sft_tokenized/sft_L512"
    assert default_out_dir(SFT, "data/chats.jsonl", 256) == "out/sft_tokenized/chats_L256"


def test_sentencepiece_training_is_quiet_by_default(tmp_path):
    import subprocess
    import sys
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"line {i} of some text to learn pieces from, 中文 {i % 7}" for i in range(300)))
    r = subprocess.run([sys.executable, "-m", "tokenizer.train_tokenizer", f"--data_dir={corpus}",
                        f"--out_dir={tmp_path / 'tok'}", "--vocab_size=384", "--tokenizer_type=sp_bbpe",
                        "--num_threads=1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trainer_interface.cc" not in r.stderr and len((r.stdout + r.stderr).splitlines()) < 30


# ---------------------------------------------------------------------------- answers before torch
# A typo, a bad value, a path that is not there, a checkpoint that names nothing and --help are answered
# before the commands import torch (trainer/precheck.py, inference/loading.py precheck, utils.run_dir): the same
# line and exit code as the full path, in a fraction of a second instead of the torch import (tens of
# seconds on a busy machine). Each case runs as a real process under `python -X importtime`: no `torch`
# module may appear; the seconds are printed (`pytest -s`) for the record, never asserted.

import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from tests.conftest import ROOT  # noqa: E402
from utils.constants import EXIT_BAD_CONFIG, EXIT_OK  # noqa: E402


def _run_without_torch(argv: list[str], label: str = "") -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr without the import-time lines, seconds); asserts torch was never imported."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    seconds = time.perf_counter() - t0
    imported = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert imported, "python -X importtime printed nothing"
    torch_mods = [m for m in imported if m == "torch" or m.startswith("torch.")]
    assert not torch_mods, f"{argv} imported {torch_mods[:3]}"
    err = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    label = label or " ".join(os.path.basename(a) for a in argv)[:100]
    print(f"\n[answer time] {seconds:.2f}s rc={proc.returncode}: {label}")
    return proc.returncode, proc.stdout, err, seconds


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def two_step_run(tiny_pretrain_run_args, tmp_path_factory) -> dict:
    """A finished 2-step run with checkpoints at steps 1 and 2 (made in this process)."""
    import train_my_ddp as T
    out = tmp_path_factory.mktemp("cli") / "run"
    assert T.main([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=2", "--checkpoint_interval=1"]) == 0
    return {"out": out, "args": tiny_pretrain_run_args}


def _trainer_cases(args: list[str], run, tmp) -> list[tuple[str, list[str]]]:
    (tmp / "bad.yaml").write_text("learning_rate: 1e-3\nmax_stepz: 5\n")
    return [
        ("typo", ["--max_stepz=5"]),
        ("bad_type", [*args, "--batch_size=abc"]),
        ("config_file_typo", [str(tmp / "bad.yaml")]),
        ("bad_value", [*args, f"--out_dir={tmp / 'new'}", "--log_interval=0"]),
        ("two_bad_values", [*args, f"--out_dir={tmp / 'new'}", "--beta2=1.5", "--lr_schedule=exp"]),
        ("resume_choice", [*args, f"--out_dir={tmp / 'new'}", "--resume=sometimes"]),
        ("resume_contradiction", [*args, f"--out_dir={tmp / 'new'}", "--init_from=resume", "--resume=never"]),
        ("tokenizer_dir_missing", [*args, f"--out_dir={tmp / 'new'}", "--tokenizer_dir=/nonexistent/tok"]),
        ("init_from_missing", [*args, f"--out_dir={tmp / 'new'}", "--init_from=/nonexistent/run"]),
        ("ref_model_missing", [*args, f"--out_dir={tmp / 'new'}", "--task_type=dpo", f"--init_from={run}",
                               "--ref_model=/nonexistent/ref"]),
        ("resume_never_with_checkpoints", [*args, f"--out_dir={run}", "--max_iters=2", "--resume=never"]),
        ("resume_always_with_nothing", [*args, f"--out_dir={tmp / 'empty'}", "--resume=always"]),
        ("init_from_resume_with_nothing", [*args, f"--out_dir={tmp / 'empty'}", "--init_from=resume"]),
        ("bad_value_of_a_continuing_run", [*args, f"--out_dir={run}", "--max_iters=4", "--eval_iters=0"]),
        ("num_train_epochs_negative", [*args, f"--out_dir={tmp / 'new'}", "--num_train_epochs=-1"]),
        ("sample_prompts_missing_file", [*args, f"--out_dir={tmp / 'new'}", "--sample_every=2",
                                         "--sample_prompts=/nonexistent/prompts.txt"]),
        # the parallel layout is checked without torch too (parallel/config.py): the world, the capabilities
        ("pipeline_combination", [*args, f"--out_dir={tmp / 'pp'}", "--pipeline_parallel_size=2",
                                  "--tie_embeddings=true"]),
        ("fsdp_with_zero", [*args, f"--out_dir={tmp / 'new'}", "--parallel=fsdp", "--use_distributed_optimizer=true"]),
        # the optimizer's own rule (optimizer/optimizer_config.py bf16_state_conflicts), read without torch
        ("bf16_moments_with_muon", [*args, f"--out_dir={tmp / 'new'}", "--optimizer_state_dtype=bf16",
                                    "--optimizer=muon"]),
    ]


def test_trainer_answers_mistakes_before_importing_torch(two_step_run, tmp_path, capsys):
    """Each mistake: exit 2 and the very line the full path (train_my_ddp.main in this process, torch
    imported) prints, from a process that never imported torch; --help likewise, with the program name."""
    import train_my_ddp as T
    run, args = two_step_run["out"], two_step_run["args"]
    trainer = os.path.join(ROOT, "train_my_ddp.py")
    before = sorted(os.listdir(run))
    for name, argv in _trainer_cases(args, run, tmp_path):
        with capsys.disabled():
            code, _, err, _ = _run_without_torch([trainer, *argv], f"train_my_ddp.py [{name}]")
        full_code = T.main(argv)
        full_err = capsys.readouterr().err
        assert code == full_code == EXIT_BAD_CONFIG, (name, err, full_err)
        assert _error_lines(err) == [line for line in _error_lines(full_err) if "error:" in line], name
        assert len(_error_lines(err)) == 1 and "error: " in err and "Traceback" not in err, (name, err)
    assert sorted(os.listdir(run)) == before  # nothing written by the refusals
    with capsys.disabled():
        code, out, err, _ = _run_without_torch([trainer, "--help"])
    assert code == EXIT_OK and not err.strip()
    assert "usage: train_my_ddp.py [config.py|config.json|config.yaml ...] [--key=value ...]" in out
    assert "--resume='auto'" in out
    T.main(["--help"])
    assert capsys.readouterr().out.strip() == out.strip()  # the same text with and without torch


def test_sample_and_export_answer_bad_checkpoints_before_importing_torch(two_step_run, tmp_path, capsys):
    """A --checkpoint that names nothing, a --ckpt that is not there, --help: exit 2 (0) with the line
    the full choice of checkpoint (checkpoint.select.select_checkpoint + selection_exit_code) gives."""
    from checkpoint.select import select_checkpoint
    from checkpoint.verify import selection_exit_code
    from inference.loading import select_for_inference
    from utils.errors import CheckpointError, one_line
    run = str(two_step_run["out"])
    one = os.path.join(run, "checkpoints", "step_00000001")
    missing = str(tmp_path / "nothing_here")
    cases = [(run, "bogus"), (run, "step_999"), (run, "7"), (missing, "latest"), (missing, "best"),
             (missing, "step_3"), (one, "best"), (one, "step_1")]
    for path, which in cases:
        try:
            select_checkpoint(path, which, log=lambda m: None)
            raise AssertionError(f"{path} {which} was accepted")
        except CheckpointError as e:
            full_msg, full_code = one_line(e), selection_exit_code(e, path, which)
        assert full_code == EXIT_BAD_CONFIG
        with capsys.disabled():
            code, _, err, _ = _run_without_torch([os.path.join(ROOT, "sample.py"), f"--ckpt={path}",
                                                  f"--checkpoint={which}"])
        assert (code, _error_lines(err)) == (full_code, [f"sample.py: {full_msg}"])
        with pytest.raises(Exception) as e:  # sample.py's own full path says the same
            select_for_inference(path, which, log=lambda m: None)
        assert (e.value.code, str(e.value)) == (full_code, full_msg)
        with capsys.disabled():
            code, _, err, _ = _run_without_torch([os.path.join(ROOT, "export_hf.py"), f"--ckpt={path}",
                                                  f"--checkpoint={which}", f"--out_dir={tmp_path / 'hf'}"])
        assert (code, _error_lines(err)) == (full_code, [f"export_hf: {full_msg}"])
    assert not (tmp_path / "hf").exists()
    with capsys.disabled():
        code, _, err, _ = _run_without_torch([os.path.join(ROOT, "sample.py"), f"--ckpt={run}",
                                              "--tokenizer_dir=/nonexistent/tok"])
    assert (code, _error_lines(err)) == (EXIT_BAD_CONFIG, ["sample.py: --tokenizer_dir=/nonexistent/tok: not a directory"])
    for script in ("sample.py", "export_hf.py"):
        with capsys.disabled():
            code, out, _, _ = _run_without_torch([os.path.join(ROOT, script), "--help"])
        assert code == EXIT_OK and "--checkpoint" in out


@pytest.mark.parametrize("module", ["tokenizer.train_tokenizer", "tokenizer.extend_tokenizer",
                                    "data_preprocess.pretokenize_pretrain_data",
                                    "data_preprocess.build_pretrain_sample_index_map",
                                    "data_preprocess.pretokenize_sft_data", "data_preprocess.pretokenize_dpo_data"])
def test_preprocessing_commands_parse_flags_before_importing_torch(module, capsys):
    with capsys.disabled():
        code, out, _, _ = _run_without_torch(["-m", module, "--help"])
    assert code == EXIT_OK and "--" in out
    with capsys.disabled():
        code, _, err, _ = _run_without_torch(["-m", module, "--no_such_flagz=1"])
    assert code == EXIT_BAD_CONFIG and "error:" in err  # argparse: usage + the missing or unknown flags


# ---------------------------------------------------------------------------- runs that continue by themselves

def _steps(out_dir) -> list[int]:
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def test_the_same_command_twice_continues_the_run(tiny_pretrain_run_args, tmp_path, capsys, monkeypatch):
    """--resume=auto (the default): the first start is a new run, the same command after a failure
    continues from the newest checkpoint; each step is logged once. --resume=never refuses,
    --init_from=resume still continues, and an out_dir with run_start.json but no checkpoint starts
    as recorded."""
    import train_my_ddp as T
    out = tmp_path / "run"
    cmd = [*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=4", "--checkpoint_interval=1"]
    monkeypatch.setenv("MYLLM_FAULT", "nan_loss@3")  # the first attempt stops at step 3 (exit 4), checkpoint 2 kept
    assert T.main(cmd) == 4
    first = capsys.readouterr().out
    assert f"[init] new run from scratch in {out} (--resume=auto)" in first
    monkeypatch.delenv("MYLLM_FAULT")
    assert T.main(cmd) == 0  # the same command again
    second = capsys.readouterr().out
    assert f"[resume] continuing {out} from step 2 (--resume=auto)" in second and "[init] new run" not in second
    assert _steps(out) == [1, 2, 3, 4]

    assert T.main([*cmd, "--resume=never"]) == EXIT_BAD_CONFIG
    assert "--resume=never does not continue it" in capsys.readouterr().err

    assert T.main([*cmd[:-2], "--max_iters=5", "--init_from=resume"]) == 0  # the old spelling, one more step
    assert f"[resume] continuing {out} from step 4 (--init_from=resume)" in capsys.readouterr().out
    assert _steps(out) == [1, 2, 3, 4, 5]

    recorded = tmp_path / "recorded"  # crashed before its first checkpoint: run_start.json, no checkpoint
    recorded.mkdir()
    shutil.copy(out / "run_start.json", recorded / "run_start.json")
    assert T.main([*tiny_pretrain_run_args, f"--out_dir={recorded}", "--max_iters=1"]) == 0
    log = capsys.readouterr().out
    assert f"[resume] no checkpoint in {recorded} yet: starting as the run did, from scratch" in log
    assert "(recorded in run_start.json; --resume=auto)" in log and _steps(recorded) == [1]


def test_piped_output_gets_a_line_every_few_seconds(monkeypatch):
    """stdout not a terminal (no progress bar): a step line when --log_interval says so, and also when
    none came for QUIET_LINE_EVERY_S seconds; on a terminal only when --log_interval says so."""
    from trainer import console as T
    monkeypatch.setattr(T, "_last_line_at", [0.0])
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    every = T.QUIET_LINE_EVERY_S
    assert T.line_due(True, now=1000.0)
    assert not T.line_due(False, now=1000.0 + every / 2)
    assert T.line_due(False, now=1000.0 + every + 0.1)
    assert not T.line_due(False, now=1000.0 + every + 1)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    assert not T.line_due(False, now=1000.0 + 10 * every)
    assert T.line_due(True, now=1000.0 + 10 * every)


def test_the_trainer_names_the_command_that_takes_a_hugging_face_dataset():
    """--hf_dataset is the preprocessing commands' input flag: the trainer says where it goes, not only that the
    key is unknown."""
    from trainer.config import TrainConfig
    from utils.configurator import ConfigError, parse_config
    with pytest.raises(ConfigError) as e:
        parse_config(TrainConfig(), ["--hf_dataset=json", "--data_dir=d"])
    msg = str(e.value)
    assert "unknown config key 'hf_dataset'" in msg and "data_preprocess.pretokenize_pretrain_data --hf_dataset" in msg
