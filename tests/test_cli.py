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
