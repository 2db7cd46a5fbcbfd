"""Resume across a changed topology with the same global batch (issue 21).

A run saved at one (ranks, batch, accumulation) layout resumes at another with the same number of
samples per optimizer step: the data cursor counts samples (dataset/loader.py), every engine
re-shards its state, and the losses after the resume follow the uninterrupted run.

Per case, three real trainer runs (fp32, CPU, gloo):
  A  the uninterrupted run at the first layout, 6 steps, checkpoints at 3 and 6;
  B  the same 6 steps from scratch at the second layout: how far two layouts drift apart by
     summation order alone (the tolerance is derived from it, not guessed);
  R  A's checkpoint at step 3 resumed at the second layout to step 6.
Step 4's loss is computed from the weights R loaded, on the samples its cursor chose: it equals A's
to the step-1 difference between the layouts (same weights, same samples, other grouping), which is
what shows the same samples were read. Steps 5-6 follow A within B's measured drift.
"""
from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import run_cmd
from tests.trainer.test_end_to_end import _env, losses, train_cmd

STEPS, SAVE_AT = 6, 3
EPS32 = 2.0 ** -23

# (name, (processes, flags) before, (processes, flags) after); global batch 8 samples per step in every layout
CASES = [
    ("ddp-2to1", (2, ["--batch_size=2", "--gradient_accumulation_steps=2"]),
     (1, ["--batch_size=2", "--gradient_accumulation_steps=4"])),
    ("zero2-1to2", (1, ["--batch_size=4", "--gradient_accumulation_steps=2", "--use_distributed_optimizer=true",
                        "--zero_stage=2"]),
     (2, ["--batch_size=4", "--gradient_accumulation_steps=1", "--use_distributed_optimizer=true",
          "--zero_stage=2"])),
    ("fsdp-2to1", (2, ["--batch_size=2", "--gradient_accumulation_steps=2", "--parallel=fsdp"]),
     (1, ["--batch_size=4", "--gradient_accumulation_steps=2", "--parallel=fsdp"])),
    ("pipeline-4to2", (4, ["--batch_size=2", "--gradient_accumulation_steps=2", "--pipeline_parallel_size=2"]),
     (2, ["--batch_size=2", "--gradient_accumulation_steps=4", "--pipeline_parallel_size=2"])),
]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("name,before,after", CASES, ids=[c[0] for c in CASES])
def test_resume_at_another_layout_follows_the_uninterrupted_run(tiny_pretrain_run_args, tmp_path, name, before, after):
    base = [a for a in tiny_pretrain_run_args if not a.startswith(("--batch_size", "--checkpoint_interval"))]
    base += [f"--max_iters={STEPS}", f"--checkpoint_interval={SAVE_AT}", "--keep_last=5"]
    a_dir, b_dir, r_dir = tmp_path / "a", tmp_path / "b", tmp_path / "r"
    run_cmd(train_cmd([*base, *before[1], f"--out_dir={a_dir}"], before[0]), env=_env())
    run_cmd(train_cmd([*base, *after[1], f"--out_dir={b_dir}"], after[0]), env=_env())
    la, lb = losses(a_dir), losses(b_dir)
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))

    # R: A as it stood at its step-3 checkpoint (later checkpoint and metrics rows removed), resumed at B's layout
    shutil.copytree(a_dir, r_dir)
    shutil.rmtree(r_dir / "checkpoints" / f"step_{STEPS:08d}")
    rows = [ln for ln in open(r_dir / "metrics.jsonl") if json.loads(ln)["step"] <= SAVE_AT]
    (r_dir / "metrics.jsonl").write_text("".join(rows))
    proc = run_cmd(train_cmd([f"--out_dir={r_dir}", "--init_from=resume", *after[1]], after[0]), env=_env())
    assert "[resume] at step 3" in proc.stdout, proc.stdout[-2000:]
    lr = losses(r_dir)
    assert sorted(lr) == list(range(1, STEPS + 1))

    # tolerances from the runs themselves, floored at a few fp32 ulps of the loss
    same_weights = max(_rel(la[1], lb[1]), 8 * EPS32)        # same weights and samples, other grouping
    drift = max(max(_rel(la[s], lb[s]) for s in la), 8 * EPS32)  # the layouts trained apart, summation order only
    print(f"{name}: step-1 layout difference {same_weights:.2e}, drift {drift:.2e}, resumed vs uninterrupted "
          f"{[f'{_rel(lr[s], la[s]):.2e}' for s in range(SAVE_AT + 1, STEPS + 1)]}")
    assert _rel(lr[SAVE_AT + 1], la[SAVE_AT + 1]) <= 4 * same_weights, (name, lr, la, lb)
    for s in range(SAVE_AT + 2, STEPS + 1):
        assert _rel(lr[s], la[s]) <= 4 * drift, (name, s, lr, la, lb)
    # reading other samples would show: the losses of different steps differ by far more than the drift
    assert min(_rel(la[s], la[s + 1]) for s in range(1, STEPS)) > 10 * drift, (la, drift)
