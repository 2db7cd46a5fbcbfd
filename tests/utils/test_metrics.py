"""utils.metrics: grouped dashboard tags, windowed throughput, the W&B sink (offline) and resplot's
smoothed throughput and DPO panels."""
from __future__ import annotations

import json
import os
import sys

import pytest

from utils.metrics import MetricsLogger, Throughput, format_line, metric_tag


def test_metric_tags_are_grouped():
    assert metric_tag("loss") == "train/loss"
    assert metric_tag("lr") == "train/lr"
    assert metric_tag("grad_norm") == "train/grad_norm"
    assert metric_tag("val_loss") == "eval/loss"
    assert metric_tag("reward_acc") == "dpo/reward_acc"
    assert metric_tag("val_reward_acc") == "eval/dpo_reward_acc"
    assert metric_tag("tokens_per_sec_avg") == "perf/tokens_per_sec_avg"
    assert metric_tag("mem_peak_mib") == "perf/mem_peak_mib"


def test_throughput_window_is_total_tokens_over_total_time():
    t = Throughput(window=3)
    assert t.add([(1000, 1.0)]) == 1000.0
    # a slow step (an evaluation, a busy core) moves the average, not 10x
    assert t.add([(1000, 10.0)]) == pytest.approx(2000 / 11.0)
    t.add([(1000, 1.0)])
    assert t.add([(1000, 1.0)]) == pytest.approx(3000 / 12.0)  # the first step left the window
    assert t.add([(1000, 1.0)]) == pytest.approx(1000.0)


def test_throughput_leaves_out_the_warmup_steps():
    t = Throughput(window=3, warmup=2)
    assert t.add([(1000, 40.0)]) is None and t.add([(1000, 2.0)]) is None  # the compile step, then one more
    assert t.add([(1000, 1.0)]) == 1000.0
    assert t.add([(1000, 1.0), (2000, 1.0)]) == pytest.approx(4000 / 3.0)


def test_step_timer_charges_no_restart_gap_to_a_step():
    import time

    from utils.device import StepTimer
    timer = StepTimer("cpu")
    time.sleep(0.05)
    (tokens, first), = timer.lap(10)
    assert tokens == 10 and first >= 0.05
    time.sleep(0.2)  # an evaluation or a checkpoint
    timer.restart()
    (_, second), = timer.lap(10)
    assert second < 0.2  # the gap before restart() is not in the next step


def test_count_tokens_leaves_out_padding():
    import torch

    from trainer.task import count_tokens
    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert count_tokens({"input_ids": ids, "labels": ids}) == 10
    assert count_tokens({"input_ids": ids, "labels": ids, "attention_mask": mask}) == 8
    assert count_tokens({"chosen_input_ids": ids, "chosen_attention_mask": mask,
                         "rejected_input_ids": ids, "rejected_attention_mask": 1 - mask}) == 10


def test_console_line_shows_the_total_elapsed_and_eta():
    from utils.metrics import format_duration
    line = format_line({"step": 50, "loss": 2.0}, total=2000, elapsed=83.4, eta=2710.0)
    assert line.startswith("step 50/2000 | loss 2.0000") and line.endswith("elapsed 0:01:23 | eta 0:45:10")
    assert format_duration(90061) == "1d 1:01:01" and format_line({"step": 3}) == "step 3"


def test_log_lines_respect_a_given_interval_when_not_a_terminal(tiny_pretrain_run_args, tmp_path, monkeypatch):
    """Without a terminal the trainer adds a line every QUIET_LINE_EVERY_S seconds (here: every step) only
    when the user did not choose --log_interval; a chosen interval is kept, and every line has the total
    and, after the warm-up steps, an ETA."""
    import train_my_ddp as T
    from trainer import console
    monkeypatch.setattr(console, "QUIET_LINE_EVERY_S", 0.0)
    args = [a for a in tiny_pretrain_run_args if not a.startswith("--log_interval")]

    def lines(extra, out):
        import contextlib
        import io
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert T.main([*args, *extra, f"--out_dir={tmp_path / out}", "--max_iters=6"]) == 0
        return [ln for ln in buf.getvalue().splitlines() if ln.startswith("step ")]
    given = lines(["--log_interval=3"], "given")
    assert [ln.split(" |")[0] for ln in given] == ["step 1/6", "step 3/6", "step 6/6"], given
    assert "eta " in given[-1] and "elapsed " in given[-1]
    default = lines([], "default")
    assert [ln.split(" |")[0] for ln in default] == [f"step {s}/6" for s in range(1, 7)], default


def test_console_line_marks_estimated_mfu():
    line = format_line({"step": 3, "loss": 1.0, "tokens_per_sec": 50.0, "tokens_per_sec_avg": 40.0,
                        "mfu": 0.5, "mfu_is_estimate": True})
    assert "tokens/s 40" in line and "mfu~ 50.00%" in line
    assert "mfu 50.00%" in format_line({"step": 3, "mfu": 0.5})


def test_wandb_offline_resume_continues_the_run_with_monotonic_steps(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = str(tmp_path)
    m = MetricsLogger(out, wandb=True, wandb_project="p", wandb_run_name="r", log=lambda s: None)
    for s in (1, 2, 3):
        m.write({"step": s, "loss": 1.0 / s, "val_loss": 2.0})
    run_id = m.wandb.run.id
    m.close()
    state = json.loads((tmp_path / "wandb_run.json").read_text())
    assert state == {"id": run_id, "last_step": 3}
    # the trainer crashed after step 3 but resumed from a checkpoint at step 2: steps 3.. are re-done
    m2 = MetricsLogger(out, wandb=True, wandb_project="p", wandb_run_name="r", log=lambda s: None)
    assert m2.wandb.run.id == run_id
    for s in (3, 4):
        m2.write({"step": s, "loss": 0.1})
    assert m2.wandb.skipped == 1 and m2.wandb.last_step == 4
    m2.close()
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run-")]
    assert runs and all(run_id in d for d in runs)  # offline run files, one W&B run id
    assert any(f.endswith(".wandb") for d in runs for f in os.listdir(tmp_path / "wandb" / d))


def test_wandb_missing_is_logged_not_fatal(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    said = []
    m = MetricsLogger(str(tmp_path), wandb=True, log=said.append)
    m.write({"step": 1, "loss": 1.0})
    assert m.wandb is None and any("wandb not installed" in s for s in said)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0


def test_resplot_dpo_panels_and_smoothed_throughput(tmp_path):
    from utils.resplot import _series, moving_average, plot_runs
    assert moving_average([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    d = tmp_path / "dpo"
    d.mkdir()
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(1, 11):
            f.write(json.dumps({"step": s, "loss": 0.7, "tokens_per_sec": 100.0 * (s % 3 + 1),
                                "chosen_reward": 0.1 * s, "rejected_reward": -0.1 * s, "reward_acc": 0.5}) + "\n")
    recs = [json.loads(line) for line in open(d / "metrics.jsonl")]
    steps, margin = _series(recs, "reward_margin")
    assert steps == list(range(1, 11)) and margin[4] == pytest.approx(1.0)
    out = plot_runs([str(d)], str(tmp_path / "c.png"))
    assert open(out, "rb").read(4) == b"\x89PNG"


def test_resplot_axes_linear_dpo_apart_validation_accuracy_and_restarts(tmp_path, monkeypatch):
    """An LM run and a DPO run in one figure: linear loss axes, the DPO loss on its own panel (never on the
    LM loss's), the validation reward accuracy drawn, and each restart a vertical line at its step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from utils.resplot import plot_runs, restart_steps
    lm, dpo = tmp_path / "lm", tmp_path / "dpo"
    for d in (lm, dpo):
        d.mkdir()
    (lm / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 7.0 - 0.1 * s, "lr": 1e-3,
                                                          "tokens_per_sec": 10.0}) + "\n" for s in range(1, 9)))
    (lm / "metrics.jsonl.after_step4.123.old").write_text("")
    (lm / "monitor_summary.json").write_text(json.dumps({"attempts": [{"resumed_from_step": 0},
                                                                     {"resumed_from_step": 6}]}))
    (dpo / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": 0.69, "reward_acc": 0.6, "chosen_reward": 0.1, "rejected_reward": 0.0,
         **({"val_loss": 0.68, "val_reward_acc": 0.7} if s % 2 == 0 else {})}) + "\n" for s in range(1, 7)))
    assert restart_steps(str(lm)) == [4, 6] and restart_steps(str(dpo)) == []
    saved = {}
    monkeypatch.setattr(plt.Figure, "savefig", lambda self, *a, **k: saved.setdefault("fig", self))
    plot_runs([str(lm), str(dpo)], str(tmp_path / "c.png"))
    axes = {ax.get_title(): ax for ax in saved["fig"].axes if ax.get_visible()}
    assert all(ax.get_yscale() == "linear" for ax in axes.values())
    lm_loss = axes["train loss"]
    assert [ln.get_label() for ln in lm_loss.get_lines() if not ln.get_label().startswith("_")] == ["lm"]
    dpo_loss = axes["DPO loss (train line, validation dots)"]
    assert {ln.get_label() for ln in dpo_loss.get_lines()} >= {"dpo", "dpo (validation)"}
    acc = axes["DPO reward accuracy (train line, validation dots)"]
    val = [ln for ln in acc.get_lines() if ln.get_label() == "dpo (validation)"][0]
    assert list(val.get_xdata()) == [2, 4, 6] and list(val.get_ydata()) == [0.7, 0.7, 0.7]
    vlines = sorted({float(ln.get_xdata()[0]) for ln in lm_loss.get_lines() if ln.get_label().startswith("_")
                     and len(set(ln.get_xdata())) == 1})
    assert vlines == [4.0, 6.0]


def test_resume_keeps_each_step_once_and_the_crashed_rows_aside(tmp_path):
    """A resume at step 3 after an attempt that logged steps 1-5 and died mid-line: metrics.jsonl keeps
    1-3, the rows of 4-5 and the torn line go to metrics.jsonl.after_step3.<time>.old."""
    from utils.metrics import MetricsLogger, read_metrics
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in range(1, 6)]
    path.write_text("".join(rows) + '{"step": 6, "lo')
    said = []
    m = MetricsLogger(str(tmp_path), resume_step=3, log=said.append)
    m.write({"step": 4, "loss": 1.5})
    m.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(str(path))] == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 1.5)]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.after_step3.")]
    assert len(aside) == 1
    assert aside[0].read_text().splitlines() == [rows[3].strip(), rows[4].strip(), '{"step": 6, "lo']
    assert "3 row(s)" in said[0]
    # nothing after the resumed step: the file is left as it is, nothing set aside
    MetricsLogger(str(tmp_path), resume_step=4, log=said.append).close()
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("metrics.jsonl.after")]) == 1


@pytest.mark.parametrize("name", ["metrics.jsonl", "samples.jsonl"])
def test_torn_utf8_last_line_is_set_aside_not_a_decode_error(tmp_path, name):
    """A crash mid-write can cut a multi-byte UTF-8 character (samples are written with ensure_ascii=False):
    the resume sets the torn line aside with the other rows of the crashed attempt, byte for byte, and
    read_metrics skips it, instead of UnicodeDecodeError on every resume."""
    from utils.metrics import MetricsLogger, read_metrics
    path = tmp_path / name
    rows = [json.dumps({"step": s, "loss": 1.0, "prompt": "病人", "completion": "发热"}, ensure_ascii=False) + "\n"
            for s in (1, 2)]
    torn = json.dumps({"step": 3, "completion": "咳嗽"}, ensure_ascii=False).encode("utf-8")
    torn = torn[:torn.index("嗽".encode("utf-8")) + 1]  # one byte of a three-byte character
    path.write_bytes("".join(rows).encode("utf-8") + torn)
    assert [r["step"] for r in read_metrics(str(path))] == [1, 2]
    said = []
    MetricsLogger(str(tmp_path), resume_step=2, log=said.append).close()
    assert path.read_text(encoding="utf-8") == "".join(rows)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(f"{name}.after_step2.")]
    assert len(aside) == 1 and aside[0].read_bytes() == torn + b"\n"
    assert any("1 row(s)" in s for s in said)


def _tensorboard_series(tb_dir):
    """{tag: [(step, value), ...]} of every scalar in tb_dir, read back by TensorBoard's own reader (its
    purge of a restarted run's stale steps included), and {tag: [(step, text), ...]} of the text summaries."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
    texts = {t: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(t)] for t in tags["tensors"]}
    return scalars, texts


def _age_event_files(tb_dir, seconds):
    """Back-date the event files written so far (their names start with the creation time in seconds, and the
    reader takes a directory's files in name order): the attempt that crashed ran before its resume, never in the
    same second, whatever writer counter this process has reached."""
    for name in os.listdir(tb_dir):
        parts = name.split(".")
        assert parts[:3] == ["events", "out", "tfevents"], name
        parts[3] = "%010d" % (int(parts[3]) - seconds)
        os.rename(os.path.join(tb_dir, name), os.path.join(tb_dir, ".".join(parts)))


def test_tensorboard_event_files_hold_the_scalars_and_a_resume_purges_the_crashed_attempts_steps(tmp_path):
    """The real SummaryWriter path: grouped tags, steps and values as written; then a resume from step 3 of an
    attempt that logged to step 6: TensorBoard's reader shows each step once, steps 1-3 of the first attempt and
    4-8 of the resumed one (purge_step = resume step + 1), the first attempt's val point at step 6 gone (the
    reader purges scalar series, not text: samples are checked before the resume only)."""
    pytest.importorskip("tensorboard")
    tb_dir = tmp_path / "tensorboard"
    first = MetricsLogger(str(tmp_path), tensorboard=True, log=lambda *a: None)
    assert first.tb is not None
    for step in range(1, 7):
        rec = {"step": step, "loss": 10.0 + step, "lr": 1e-3 * step, "tokens_per_sec": 1000 * step}
        if step % 3 == 0:
            rec["val_loss"] = 20.0 + step
        first.write(rec)
    first.write_samples([{"step": 6, "prompt": "p", "completion": "c"}])
    first.close()
    scalars, texts = _tensorboard_series(tb_dir)
    assert set(scalars) == {"train/loss", "train/lr", "perf/tokens_per_sec", "eval/loss"}
    assert scalars["train/loss"] == [(s, 10.0 + s) for s in range(1, 7)]
    assert [s for s, _ in scalars["train/lr"]] == list(range(1, 7))
    assert [v for _, v in scalars["train/lr"]] == pytest.approx([1e-3 * s for s in range(1, 7)])
    assert scalars["perf/tokens_per_sec"] == [(s, 1000.0 * s) for s in range(1, 7)]
    assert scalars["eval/loss"] == [(3, 23.0), (6, 26.0)]
    assert texts == {"samples/0/text_summary": [(6, "**p** c")]}

    _age_event_files(tb_dir, 10)
    resumed = MetricsLogger(str(tmp_path), tensorboard=True, log=lambda *a: None, resume_step=3)
    for step in range(4, 9):
        rec = {"step": step, "loss": 100.0 + step}
        if step % 3 == 0:
            rec["val_loss"] = 200.0 + step
        resumed.write(rec)
    resumed.close()
    assert len([n for n in os.listdir(tb_dir) if n.startswith("events.out.tfevents.")]) == 2
    scalars, _ = _tensorboard_series(tb_dir)
    assert scalars["train/loss"] == [(1, 11.0), (2, 12.0), (3, 13.0)] + [(s, 100.0 + s) for s in range(4, 9)]
    assert scalars["eval/loss"] == [(3, 23.0), (6, 206.0)]
    assert [s for s, _ in scalars["train/lr"]] == [1, 2, 3]
    assert scalars["perf/tokens_per_sec"] == [(s, 1000.0 * s) for s in range(1, 4)]

# ---------------------------------------------------------------------------- a disk that fills between saves

def _full_disk_open(monkeypatch, module, victim: str, err: int):
    """`open` in `module` raising OSError(err) for a write of `victim` (what a full disk, a full quota or a
    file-size limit answers); every other open is the real one."""
    import builtins
    import errno

    real = builtins.open

    def fake(path, mode="r", *a, **kw):
        if os.path.basename(str(path)) == victim and any(c in mode for c in "aw"):
            raise OSError(err, os.strerror(err))  # no filename: the write itself failed, as f.write reports it
        return real(path, mode, *a, **kw)
    monkeypatch.setattr(module, "open", fake, raising=False)
    return errno


@pytest.mark.parametrize("victim, call", [
    ("metrics.jsonl", lambda m: m.write({"step": 1, "loss": 2.0})),
    ("samples.jsonl", lambda m: m.write_samples([{"step": 1, "prompt": "a", "completion": "b"}])),
    ("heartbeat", lambda m: m.heartbeat()),
])
@pytest.mark.parametrize("err", ["ENOSPC", "EDQUOT", "EFBIG"])
def test_a_full_disk_under_the_metrics_writers_is_exit_7_naming_the_file(tmp_path, monkeypatch, victim, call, err):
    """metrics.write / write_samples / heartbeat on a disk that filled since the last save: one DiskFullError
    naming the file (exit 7, never retried by the supervisor), not an OSError traceback (exit 1, retried)."""
    import errno

    import utils.metrics as M
    from utils.constants import EXIT_DISK_FULL, NON_RETRYABLE_EXIT_CODES
    from utils.disk_space import DiskFullError
    from utils.errors import exit_code_for
    m = MetricsLogger(str(tmp_path), log=lambda s: None)
    _full_disk_open(monkeypatch, M, victim, getattr(errno, err))
    with pytest.raises(DiskFullError) as e:
        call(m)
    code, line = exit_code_for(e.value)
    assert code == EXIT_DISK_FULL and code in NON_RETRYABLE_EXIT_CODES
    assert line.startswith(f"disk full: writing {tmp_path / victim} did not fit") and " free on " in line, line
    assert "\n" not in line


def test_other_write_errors_of_the_metrics_pass_unchanged(tmp_path, monkeypatch):
    """Only a write that did not fit becomes exit 7: a permission error stays what it was."""
    import errno

    import utils.metrics as M
    from utils.disk_space import DiskFullError
    m = MetricsLogger(str(tmp_path), log=lambda s: None)
    _full_disk_open(monkeypatch, M, "metrics.jsonl", errno.EACCES)
    with pytest.raises(OSError) as e:
        m.write({"step": 1, "loss": 2.0})
    assert not isinstance(e.value, DiskFullError) and e.value.errno == errno.EACCES
