"""The trainer queues step s+1 before it reads step s (trainer/loop.py `Loop.step`, `_Pending`): a step's loss and
gradient norm are read one step late, so on a GPU the host never waits for the device between steps. Steps that
something must see finished (a checkpoint, an evaluation, samples, the last step) are read at once.

Checked in process on CPU, where the order of the calls is the same as on a GPU: each read of a step's loss
copy and each optimizer step is recorded, and the rows are compared with what the run logged."""
from __future__ import annotations

import os

import train_my_ddp as T
import trainer.loop as loop_mod
from utils.metrics import SAMPLES_FILE, dedupe_by_step, read_metrics


def _record_order(monkeypatch):
    """Patch the loop's HostCopy (the loss sums, one per step) and the engine's optimizer step to append
    ("opt", n) / ("read", n) to a list, n counting from 1 in creation order."""
    events: list[tuple[str, int]] = []
    real_copy = loop_mod.HostCopy

    class RecordedCopy(real_copy):
        made = 0

        def __init__(self, t):
            super().__init__(t)
            RecordedCopy.made += 1
            self.n = RecordedCopy.made

        def get(self):
            events.append(("read", self.n))
            return super().get()
    monkeypatch.setattr(loop_mod, "HostCopy", RecordedCopy)

    from optimizer.mixed_precision_optimizer import MixedPrecisionOptimizer
    real_step = MixedPrecisionOptimizer.step
    steps = [0]

    def step(self):
        steps[0] += 1
        events.append(("opt", steps[0]))
        return real_step(self)
    monkeypatch.setattr(MixedPrecisionOptimizer, "step", step)
    return events


def test_a_step_is_read_after_the_next_one_is_queued(tiny_pretrain_run_args, tmp_path, monkeypatch):
    """5 steps, checkpoints at 3 (and at the last step): steps 1, 2 and 4 are read after the next step's optimizer
    step was queued, 3 and 5 at once (their checkpoints need them finished). Every row is complete."""
    events = _record_order(monkeypatch)
    out = tmp_path / "run"
    assert T.main([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=5", "--checkpoint_interval=3"]) == 0
    assert events == [("opt", 1), ("opt", 2), ("read", 1), ("opt", 3), ("read", 2), ("read", 3),
                      ("opt", 4), ("opt", 5), ("read", 4), ("read", 5)]
    rows = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    assert sorted(rows) == [1, 2, 3, 4, 5]
    for s, r in rows.items():
        assert r["stepped"] is True and 0 < r["grad_norm"] < float("inf") and 0 < r["loss"] < 10, (s, r)
        assert r["lr"] > 0 and r["tokens_seen"] > 0
    assert [rows[s]["tokens_seen"] for s in (1, 2, 3, 4, 5)] == sorted({rows[s]["tokens_seen"] for s in rows})


def test_samples_and_evaluation_see_their_step_finished(tiny_pretrain_run_args, tmp_path, monkeypatch):
    """--eval_interval=2 and --sample_every=3: steps 2, 3 and 4 are read before anything runs after them; step 1
    is read a step late."""
    events = _record_order(monkeypatch)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the\n", encoding="utf-8")
    out = tmp_path / "run"
    args = [a for a in tiny_pretrain_run_args if not a.startswith("--eval_interval")]
    assert T.main([*args, f"--out_dir={out}", "--max_iters=4", "--eval_interval=2", "--checkpoint_interval=100",
                   "--sample_every=3", f"--sample_prompts={prompts}", "--sample_max_new_tokens=2"]) == 0
    assert events == [("opt", 1), ("opt", 2), ("read", 1), ("read", 2), ("opt", 3), ("read", 3),
                      ("opt", 4), ("read", 4)]
    rows = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    assert "val_loss" in rows[2] and "val_loss" in rows[4] and "val_loss" not in rows[3]
    assert [r["step"] for r in read_metrics(os.path.join(out, SAMPLES_FILE))] == [3]


def test_a_failure_while_queueing_keeps_the_pending_steps_row(tiny_pretrain_run_args, tmp_path, monkeypatch):
    """Step 3 fails while drawing its data: step 2, queued and left unread, still gets its metrics row (read without
    the loss check), and the failure is what the run reports."""
    real_draw = loop_mod.Loop._draw
    calls = [0]

    def draw(self):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected: the data went away")
        return real_draw(self)
    monkeypatch.setattr(loop_mod.Loop, "_draw", draw)
    out = tmp_path / "run"
    try:
        code = T.main([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=5"])
    except RuntimeError as e:
        assert "injected" in str(e)
    else:
        assert code != 0
    rows = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    assert sorted(rows) == [1, 2]
    assert rows[2]["stepped"] is True and 0 < rows[2]["loss"] < 10 and rows[2]["grad_norm"] > 0
