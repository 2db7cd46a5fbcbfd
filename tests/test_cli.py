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
    assert "--max_iters" in unknown_flag_message("--num_train_epochs=3", {"max_iters"}, {})


def test_commands_share_the_convention(tmp_path):
    """The tokenizer and preprocessing commands take --out_dir (and --output_dir), bool spellings."""
    from data_preprocess.pretokenize_sft_data import default_sft_out_dir
    from tokenizer.train_tokenizer import build_arg_parser
    p = build_arg_parser()
    a = p.parse_args(["--data_dir=d", "--out_dir=o", "--vocab_size=300", "--quiet", "--no_recursive"])
    assert (a.out_dir, a.progress, a.recursive, a.verbose, a.overwrite) == ("o", False, False, False, True)
    b = p.parse_args(["--data_dir=d", "--output_dir=o", "--vocab_size=300", "--progress=false", "--overwrite=false"])
    assert (b.out_dir, b.progress, b.overwrite) == ("o", False, False)
    # the SFT default output is a named folder under out/, not a sibling of the raw data
    assert default_sft_out_dir("data/sft", 512) == "out/sft_tokenized/sft_L512"
    assert default_sft_out_dir("data/chats.jsonl", 256) == "out/sft_tokenized/chats_L256"


def test_sentencepiece_training_is_quiet_by_default(tmp_path):
    import subprocess
    import sys
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"line {i} of some text to learn pieces from, 中文 {i % 7}" for i in range(300)))
    root = __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "tokenizer.train_tokenizer", f"--data_dir={corpus}",
                        f"--out_dir={tmp_path / 'tok'}", "--vocab_size=384", "--tokenizer_type=sp_bbpe",
                        "--num_threads=1"], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trainer_interface.cc" not in r.stderr and len((r.stdout + r.stderr).splitlines()) < 30
