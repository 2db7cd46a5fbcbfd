"""scripts/demo.py (`make demo`): a short default with the long run one flag away, demo_out/ kept between runs
(finished stages skipped, the trainer continues its checkpoint), and a Ctrl-C answered with one line saying
how to continue, exit 0 under make (no make error)."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import demo  # noqa: E402


def test_default_is_short_and_the_long_run_is_one_flag_away():
    assert demo.demo_steps({}) == 300
    assert demo.demo_steps({"LONG": "1"}) == 800
    assert demo.demo_steps({"LONG": "0"}) == 300
    assert demo.demo_steps({"STEPS": "50", "LONG": "1"}) == 50
    assert demo.demo_steps({"STEPS": ""}) == 300  # make passes an empty STEPS when none was given


class _FakeStage:
    """subprocess.Popen stand-in: records the command; the trainer stage 'receives' a Ctrl-C when asked."""
    calls: list = []
    interrupt_trainer = False

    def __init__(self, args, cwd=None):
        self.args = args
        _FakeStage.calls.append(args)

    def wait(self):
        if "train_my_ddp.py" in self.args[1] and _FakeStage.interrupt_trainer:
            os.kill(os.getpid(), signal.SIGINT)  # the terminal's Ctrl-C reaches the demo too
            return 75  # the trainer saved a checkpoint and exited 75
        if "train_my_ddp.py" in self.args[1]:
            out = next(a.split("=", 1)[1] for a in self.args if a.startswith("--out_dir="))
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "metrics.jsonl"), "w") as f:
                f.write('{"step": 10, "val_loss": 5.0}\n{"step": 20, "val_loss": 4.0}\n')
        return 0


@pytest.fixture
def fake_demo(tmp_path, monkeypatch):
    out = tmp_path / "demo_out"
    monkeypatch.setattr(demo, "OUT", str(out))
    monkeypatch.setattr(demo.subprocess, "Popen", _FakeStage)
    monkeypatch.setattr(demo, "_interrupted", {"flag": False})
    saved = signal.getsignal(signal.SIGINT)
    _FakeStage.calls, _FakeStage.interrupt_trainer = [], False
    yield out
    signal.signal(signal.SIGINT, saved)


def test_ctrl_c_keeps_demo_out_and_says_how_to_continue(fake_demo, monkeypatch, capsys):
    out = fake_demo
    out.mkdir()
    (out / "keep.txt").write_text("from an earlier run")
    monkeypatch.setenv("DEMO_UNDER_MAKE", "1")
    monkeypatch.setenv("LONG", "1")
    monkeypatch.delenv("STEPS", raising=False)
    _FakeStage.interrupt_trainer = True
    assert demo.main() == 0  # under make: no make error after the line below
    err = capsys.readouterr().err
    assert (out / "keep.txt").exists()  # demo_out/ is never deleted on start
    assert "failed with exit code" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == ["demo: interrupted; run `make demo LONG=1` again to continue where it stopped (demo_out/ is "
                     "kept; `make clean` starts over)"]
    assert len(_FakeStage.calls) == 4  # three preprocessing stages, then the trainer (interrupted)
    assert any("--max_iters=800" in a for a in _FakeStage.calls[-1])
    # the same command again: the finished stages are skipped, the trainer (which resumes itself) runs
    _FakeStage.calls, _FakeStage.interrupt_trainer = [], False
    monkeypatch.setattr(demo, "_interrupted", {"flag": False})
    assert demo.main() == 0
    assert [c[1] for c in _FakeStage.calls] == ["train_my_ddp.py", "sample.py", "sample.py"]
    assert "validation loss by step: 10: 5.000, 20: 4.000" in capsys.readouterr().out


def test_ctrl_c_outside_make_exits_130(fake_demo, monkeypatch):
    monkeypatch.delenv("DEMO_UNDER_MAKE", raising=False)
    _FakeStage.interrupt_trainer = True
    assert demo.main() == 130
