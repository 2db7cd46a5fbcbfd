"""Every command that writes a directory checks up front that it can (utils/writable.py): an output directory
that cannot be created or written is one line naming the path, exit 2, before any expensive work, never a
traceback after it. Deterministic as root too: a path under a regular file cannot be created by anyone, and a
read-only place is simulated by making the probe fail there (tests/utils/test_writable.py::read_only).
The commands run in this process (their main(); an exception would fail the test as a traceback would)."""
from __future__ import annotations

import importlib
import json
import logging
import os
import shutil

import pytest

from tests.commands.test_export_hf import _save
from tests.utils.test_writable import read_only
from utils.constants import EXIT_BAD_CONFIG

KINDS = ["under_file", "read_only"]


def _destination(tmp_path, monkeypatch, kind: str):
    """(an output directory the command cannot make, what the error line says about it)."""
    if kind == "under_file":
        blocker = tmp_path / "blocker"
        blocker.write_text("x")
        return blocker / "out", f"{blocker} is a file, not a directory"
    ro = tmp_path / "ro"
    ro.mkdir()
    read_only(monkeypatch, ro)
    return ro / "out", f"cannot write in {ro}"


def _one_line(caplog, capsys, *needles: str) -> None:
    err = capsys.readouterr().err + "".join(f"{r.getMessage()}\n" for r in caplog.records
                                            if r.levelno >= logging.ERROR)
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert all(n in lines[0] for n in needles), lines[0]


def _never(what: str):
    def fail(*a, **kw):
        raise AssertionError(f"{what} before the destination was checked")
    return fail


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} about python and tokens"}) + "\n" for i in range(30)))
    return path


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", ["train_tokenizer", "extend_tokenizer"])
def test_tokenizer_commands(tmp_path, monkeypatch, caplog, capsys, corpus, tiny_pretrain_data, kind, command):
    out, why = _destination(tmp_path, monkeypatch, kind)
    if command == "train_tokenizer":
        T = importlib.import_module("tokenizer.train_tokenizer")  # the module (the package exports the function)
        monkeypatch.setattr(T, "collect_input_files", _never("the corpus was read"))
        argv = [f"--data_dir={corpus}", f"--out_dir={out}", "--vocab_size=300", "--quiet"]
    else:
        T = importlib.import_module("tokenizer.extend_tokenizer")
        monkeypatch.setattr(T, "load_base", _never("the base tokenizer was loaded"))
        argv = [f"--base_tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", f"--data_dir={corpus}",
                f"--out_dir={out}", "--num_new_tokens=8"]
    assert T.main(argv) == EXIT_BAD_CONFIG
    _one_line(caplog, capsys, f"--out_dir={out}", why)
    assert not out.exists()


@pytest.mark.parametrize("kind", KINDS)
def test_pretokenize_pretrain(tmp_path, monkeypatch, caplog, capsys, corpus, tiny_pretrain_data, kind):
    from data_preprocess import pretokenize_pretrain_data as P
    out, why = _destination(tmp_path, monkeypatch, kind)
    monkeypatch.setattr(P, "collect_inputs", _never("the inputs were read"))
    assert P.main([f"--data_dir={corpus}", f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}",
                   f"--out_dir={out}", "--num_workers=1", "--no_progress"]) == EXIT_BAD_CONFIG
    _one_line(caplog, capsys, f"--out_dir={out}", why)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_pretokenize_sft_and_dpo(tmp_path, monkeypatch, caplog, capsys, tiny_pretrain_data, kind, task):
    from data_preprocess import pretokenize_dpo_data, pretokenize_sft_data
    out, why = _destination(tmp_path, monkeypatch, kind)
    monkeypatch.setattr(pretokenize_sft_data, "make_chat_encoder", _never("the tokenizer was loaded"))
    main = pretokenize_sft_data.main if task == "sft" else pretokenize_dpo_data.main
    data = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", task)
    assert main([f"--data_dir={data}", f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=64",
                 f"--out_dir={out}", "--num_workers=1"]) == EXIT_BAD_CONFIG
    _one_line(caplog, capsys, f"--out_dir={out}", why)


@pytest.mark.parametrize("kind", ["index_is_a_file", "read_only"])
def test_index_builder(tmp_path, monkeypatch, caplog, capsys, tiny_pretrain_data, kind):
    from data_preprocess import build_pretrain_sample_index_map as B
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in os.listdir(tiny_pretrain_data["data_dir"]):
        if os.path.isfile(os.path.join(tiny_pretrain_data["data_dir"], name)):
            shutil.copy(os.path.join(tiny_pretrain_data["data_dir"], name), shards / name)
    index = shards / "index_L8"
    if kind == "index_is_a_file":
        index.write_text("x")  # its train.npy would be under a regular file
        why = f"{index} is a file, not a directory"
    else:
        read_only(monkeypatch, shards)
        why = f"cannot write in {shards}"
    monkeypatch.setattr(B, "num_samples_for", _never("the index was computed"))
    assert B.main([f"--data_dir={shards}", "--max_seq_len=8"]) == EXIT_BAD_CONFIG
    _one_line(caplog, capsys, str(index), why)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("flag", ["--out_dir", "--adapters_out_dir"])
def test_export_hf(tmp_path, monkeypatch, caplog, capsys, kind, flag):
    import export_hf
    run = tmp_path / "run"
    _save(run, 10, 3.0)
    out, why = _destination(tmp_path, monkeypatch, kind)
    argv = [f"--ckpt={run}", f"--out_dir={out if flag == '--out_dir' else tmp_path / 'hf'}"]
    if flag == "--adapters_out_dir":
        argv.append(f"--adapters_out_dir={out}")
    assert export_hf.main(argv) == EXIT_BAD_CONFIG
    _one_line(caplog, capsys, f"export_hf: {flag}={out}: ", why)
    assert not os.path.exists(tmp_path / "hf")


@pytest.mark.parametrize("entry", ["precheck", "main"])
def test_trainer_refuses_an_unwritable_checkpoints_directory_before_training(tiny_pretrain_run_args, tmp_path,
                                                                            monkeypatch, capsys, entry):
    """A read-only <out_dir>/checkpoints/ was found at the first save (a crash, retried by the supervisor on the
    same directory); now the pre-check (and main(), for a caller that skips it) refuses it: exit 2, one line."""
    import train_my_ddp
    from trainer.precheck import precheck
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    read_only(monkeypatch, out / "checkpoints")
    argv = [*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=2"]
    if entry == "precheck":
        with pytest.raises(SystemExit) as e:
            precheck(argv, title="train", prog="train_my_ddp.py")
        code = e.value.code
    else:
        code = train_my_ddp.main(argv)
    assert code == EXIT_BAD_CONFIG
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"[rank 0] error: bad configuration: --out_dir={out}: {out / 'checkpoints'}: cannot write in "
                          f"{out / 'checkpoints'}: Permission denied"), err
    assert not (out / "metrics.jsonl").exists()
