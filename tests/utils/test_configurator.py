"""utils/configurator.py: overrides, config files, type checking, errors, JSON output."""
import json
from dataclasses import dataclass, field
from typing import Optional

import pytest

from utils.configurator import ConfigError, parse_config, save_config_json


@dataclass
class Cfg:
    lr: float = 1e-3
    steps: int = 10
    name: str = "run"
    compile: bool = False
    n_kv: Optional[int] = None
    mix: dict = field(default_factory=dict)


def test_overrides_are_typed():
    c = parse_config(Cfg(), ["--lr=3e-4", "--steps=7", "--name=a b", "--compile", "--n_kv=2",
                             '--mix={"zh": 0.7, "en": 0.3}'])
    assert c.lr == pytest.approx(3e-4) and isinstance(c.lr, float)
    assert c.steps == 7 and c.name == "a b" and c.compile is True and c.n_kv == 2
    assert c.mix == {"zh": 0.7, "en": 0.3}
    assert parse_config(Cfg(), ["--compile=false"]).compile is False
    assert parse_config(Cfg(), ["--n_kv=none"]).n_kv is None
    assert parse_config(Cfg(), ["--lr=1"]).lr == 1.0  # an int literal is a fine float


@pytest.mark.parametrize("arg, needle", [
    ("--steps=1.5", "steps='1.5' is not a valid int"),
    ("--compile=maybe", "compile='maybe' is not a valid bool"),
    ("--lr=fast", "lr='fast' is not a valid float"),
    ("--stepz=3", "unknown config key 'stepz'; did you mean --steps"),
    ("positional", "unexpected argument"),
])
def test_bad_values_name_the_key(arg, needle):
    with pytest.raises(ConfigError) as e:
        parse_config(Cfg(), [arg])
    assert needle in str(e.value)


def test_config_file_then_cli_wins(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("import math\nlr = 0.5\nsteps = 3 * 4\nname = 'from_file'\n")
    c = parse_config(Cfg(), [str(f), "--name=cli"])
    assert (c.lr, c.steps, c.name) == (0.5, 12, "cli")
    bad = tmp_path / "bad.py"
    bad.write_text("steps = 'ten'\n")
    with pytest.raises(ConfigError, match="bad.py: steps='ten' is not a valid int"):
        parse_config(Cfg(), [str(bad)])
    unknown = tmp_path / "unknown.py"
    unknown.write_text("lrr = 1.0\n")
    with pytest.raises(ConfigError, match="unknown config key 'lrr'"):
        parse_config(Cfg(), [str(unknown)])


def test_resolved_config_is_json(tmp_path):
    c = parse_config(Cfg(), ["--steps=5"])
    p = tmp_path / "config.json"
    save_config_json(c, str(p))
    assert json.loads(p.read_text())["steps"] == 5


def test_only_py_json_yaml_files_are_config_files(tmp_path):
    """Issue 11 / 3.5: a positional file is read by its extension; anything else is refused, never executed."""
    notes = tmp_path / "notes.txt"
    marker = tmp_path / "executed"
    notes.write_text(f"open({str(marker)!r}, 'w').write('x')\nsteps = 3\n")
    with pytest.raises(ConfigError) as e:
        parse_config(Cfg(), [str(notes)])
    assert str(notes) in str(e.value) and ".py" in str(e.value) and ".json" in str(e.value)
    assert not marker.exists()  # the file was never executed
    j = tmp_path / "c.json"
    j.write_text('{"lr": 0.25, "steps": 4, "n_kv": null, "mix": {"a": 1}}')
    c = parse_config(Cfg(), [str(j), "--steps=5"])
    assert (c.lr, c.steps, c.n_kv, c.mix) == (0.25, 5, None, {"a": 1})
    y = tmp_path / "c.yaml"
    y.write_text("lr: 0.5\nname: from yaml\ncompile: true\n")
    c = parse_config(Cfg(), [str(y)])
    assert (c.lr, c.name, c.compile) == (0.5, "from yaml", True)
    yml = tmp_path / "c.yml"
    yml.write_text("steps: 7\n")
    assert parse_config(Cfg(), [str(yml)]).steps == 7


@pytest.mark.parametrize("name, text, needle", [
    ("bad.json", '{"steps": "ten"}', "bad.json: steps='ten' is not a valid int"),
    ("unknown.json", '{"lrr": 1}', "unknown config key 'lrr'"),
    ("list.json", "[1, 2]", "must hold a mapping of config keys"),
    ("broken.json", "{lr: ", "broken.json: not valid JSON"),
    ("broken.yaml", "lr: [1,", "broken.yaml: not valid YAML"),
    ("config.toml", "lr = 1", "config.toml: not a config file"),
])
def test_bad_data_config_files_name_the_file(tmp_path, name, text, needle):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse_config(Cfg(), [str(f)])
    assert needle in str(e.value)


def test_yaml_without_pyyaml_is_a_clear_error(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` now raises ImportError
    f = tmp_path / "c.yaml"
    f.write_text("lr: 0.5\n")
    with pytest.raises(ConfigError, match=r"c.yaml: YAML config files need PyYAML \(pip install pyyaml\)"):
        parse_config(Cfg(), [str(f)])


def test_help_says_py_configs_are_code():
    from utils.configurator import help_text
    text = help_text(Cfg(), "title")
    assert "executed as Python code" in text and ".json" in text and ".yaml" in text


def test_a_py_config_runs_once_per_process_and_again_when_edited(tmp_path, tiny_pretrain_run_args):
    """The trainer's pre-check, its start and a resume's re-parse all read the config: a .py file that counts
    (or prints, or opens files) does so once per start, not once per reading."""
    from tests.conftest import PY, run_python
    counter = tmp_path / "runs.txt"
    cfg = tmp_path / "cfg.py"
    cfg.write_text(f"open({str(counter)!r}, 'a').write('x')\nmax_iters = 2\n")
    proc = run_python([PY, "train_my_ddp.py", str(cfg), *tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert counter.read_text() == "x"
    cfg.write_text(f"open({str(counter)!r}, 'a').write('y')\nmax_iters = 2\n")  # edited: its new text runs
    from trainer.config import TrainConfig
    assert parse_config(TrainConfig(), [str(cfg)]).max_iters == 2 and counter.read_text() == "xy"
    parse_config(TrainConfig(), [str(cfg)])
    assert counter.read_text() == "xy"

def test_a_full_disk_under_the_saved_config_is_exit_7_naming_the_file(tmp_path, monkeypatch):
    """A restart on a full disk fails writing config.json: one DiskFullError naming it (exit 7), no traceback."""
    import errno

    import utils.configurator as C
    from utils.disk_space import DiskFullError
    from utils.errors import exit_code_for

    def full(path, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(C, "atomic_write_json", full)
    p = tmp_path / "config.json"
    with pytest.raises(DiskFullError) as e:
        save_config_json(parse_config(Cfg(), []), str(p))
    code, line = exit_code_for(e.value)
    assert code == 7 and line.startswith(f"disk full: writing {p} did not fit"), line
