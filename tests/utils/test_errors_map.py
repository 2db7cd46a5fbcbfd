"""One mapping from an exception to its exit code and line (utils/errors.py::exit_code_for): every error
class a command names declares its code (docs/errors.md), the trainer's "data: " / "checkpoint: " prefixes
are the ones it always printed, and anything else is left to the caller (a crash)."""
import ast
import os
import pickle
import subprocess
import sys

import pytest

from utils.configurator import ConfigError
from data_preprocess.sft_format import RecordError
from data_preprocess.shard_format import DataError, StaleIndexError
from tokenizer.corpus import CorpusConfigError, CorpusError, UnreadableFile
from utils import constants as K
from utils.errors import CheckpointError, CheckpointMismatchError, DamagedCheckpointError
from utils.disk_space import DiskFullError
from utils.dist import DeviceError
from utils.errors import TrainingError, exit_code_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("exc, code, line", [
    (TrainingError("loss is nan at step 3", K.EXIT_NONFINITE_LOSS), 4, "loss is nan at step 3"),
    (TrainingError("--lr: must be > 0", K.EXIT_BAD_CONFIG), 2, "--lr: must be > 0"),
    (ConfigError("unknown config key 'x'"), 2, "unknown config key 'x'"),
    (DeviceError("--device=cuda: no CUDA device"), 2, "--device=cuda: no CUDA device"),
    (DataError("/d: not a directory\n of token shards"), 3, "data: /d: not a directory of token shards"),
    (StaleIndexError("/d/index_meta.json: no index"), 3, "data: /d/index_meta.json: no index"),
    (RecordError("missing field 'output'"), 3, "data: missing field 'output'"),
    (CorpusError("a.jsonl:2: malformed JSON"), 3, "data: a.jsonl:2: malformed JSON"),
    (UnreadableFile("a.parquet: cannot read parquet file: x"), 3, "data: a.parquet: cannot read parquet file: x"),
    (CorpusConfigError("a.md: unsupported file type"), 2, "a.md: unsupported file type"),
    # a checkpoint error that names "checkpoint <dir>" keeps its words; any other gets the prefix
    (CheckpointError("checkpoint /r/step_2: model.safetensors is truncated"), 5,
     "checkpoint /r/step_2: model.safetensors is truncated"),
    (DamagedCheckpointError("/r/step_2/trainer_state.json: not JSON"), 5,
     "checkpoint: /r/step_2/trainer_state.json: not JSON"),
    (pickle.UnpicklingError("/r/x.pt: not loadable"), 5, "checkpoint: /r/x.pt: not loadable"),
    (CheckpointMismatchError("checkpoint /r/step_2 does not fit"), 2, "checkpoint /r/step_2 does not fit"),
    (DiskFullError("saving checkpoint /r/step_2 failed: 0 B free on /r"), 7,
     "disk full: saving checkpoint /r/step_2 failed: 0 B free on /r"),
])
def test_each_named_error_has_its_documented_code_and_line(exc, code, line):
    assert exit_code_for(exc) == (code, line)
    bare = exit_code_for(exc, prefixed=False)  # sample.py / export_hf.py print the message without a prefix
    assert bare[0] == code and line.endswith(bare[1]) and not bare[1].startswith(("data: ", "checkpoint: ",
                                                                                  "disk full: "))


def test_dcp_and_safetensors_errors_are_damaged_checkpoints():
    from safetensors import SafetensorError

    from checkpoint.dcp_files import DCPCheckpointError
    assert exit_code_for(DCPCheckpointError("checkpoint /r/step_1 is not usable: x")) == \
        (5, "checkpoint /r/step_1 is not usable: x")
    assert exit_code_for(SafetensorError("Error while deserializing header")) == \
        (5, "checkpoint: Error while deserializing header")


@pytest.mark.parametrize("exc", [ValueError("x"), RuntimeError("x"), KeyError("x"), OSError("x"),
                                 FileExistsError("x"), AssertionError()])
def test_an_error_without_a_code_is_left_to_the_caller(exc):
    assert exit_code_for(exc) is None


def test_the_declared_codes_are_the_documented_constants():
    assert (ConfigError.exit_code, DeviceError.exit_code, CheckpointMismatchError.exit_code,
            CorpusConfigError.exit_code) == (K.EXIT_BAD_CONFIG,) * 4
    assert (DataError.exit_code, RecordError.exit_code, CorpusError.exit_code) == (K.EXIT_BAD_DATA,) * 3
    assert CheckpointError.exit_code == K.EXIT_BAD_CHECKPOINT
    assert DiskFullError.exit_code == K.EXIT_DISK_FULL == 7 and 7 in K.NON_RETRYABLE_EXIT_CODES
    assert K.NON_RETRYABLE_EXIT_CODES >= {DataError.exit_code, CheckpointError.exit_code, ConfigError.exit_code}


def test_one_line_is_collapsed_and_cut():
    code, line = exit_code_for(DataError("a\n\n  b" + " Traceback (most recent call last) x" + "y" * 900))
    assert (code, line) == (3, "data: a b")
    assert len(exit_code_for(ConfigError("z" * 900))[1]) == 500


def test_errors_module_stays_at_the_bottom_and_light():
    """utils/errors.py reads the attributes: it imports no package above utils/ and never torch."""
    with open(os.path.join(ROOT, "utils", "errors.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= {"__future__", "pickle", "sys", "typing", "utils.constants"}, mods
    r = subprocess.run([sys.executable, "-c", "import sys, utils.errors as E; "
                        "E.exit_code_for(ValueError()); print(sorted(m for m in ('torch', 'safetensors', "
                        "'data_preprocess', 'tokenizer', 'utils.configurator') if m in sys.modules))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_the_commands_use_the_one_mapping():
    """No command keeps its own exception -> code chain: each calls exit_code_for (the two tokenizer
    commands through tokenizer/corpus.py's command_exit_code, sample / export / eval through
    utils/errors.py's report_named, which both do)."""
    for rel, call in (("train_my_ddp.py", "exit_code_for("), ("sample.py", "report_named("),
                      ("export_hf.py", "report_named("), ("eval_lm.py", "report_named("),
                      ("tokenizer/corpus.py", "exit_code_for("),
                      ("tokenizer/train_tokenizer.py", "command_exit_code("),
                      ("tokenizer/extend_tokenizer.py", "command_exit_code("),
                      ("data_preprocess/pretokenize_pretrain_data.py", "exit_code_for("),
                      ("data_preprocess/pretokenize_sft_data.py", "exit_code_for(")):
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            src = f.read()
        assert call in src, rel
        assert "def named_error" not in src and "SafetensorError" not in src, rel
    import inspect

    from utils.errors import report_named
    assert "exit_code_for(e, prefixed=False)" in inspect.getsource(report_named)
