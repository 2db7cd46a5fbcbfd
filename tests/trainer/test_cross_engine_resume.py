"""A run saved under one engine resumes under the other (--parallel=ddp <-> --parallel=fsdp): the weights
and the optimizer state (AdamW's exp_avg, exp_avg_sq, step per parameter, Muon's momentum, fp32 masters) are
converted per parameter name, so the resumed steps follow the uninterrupted run to the engines' own summation-order noise."""
from __future__ import annotations

import os

import pytest

from tests.conftest import run_cmd
from tests.trainer.test_end_to_end import _env, losses, train_cmd
from checkpoint.verify import list_checkpoints, verify_checkpoint
from utils.checkpoint_layout import MODEL_FILE, dcp_shard_file

NPROC = 2


@pytest.mark.parametrize("first, then", [
    (["--parallel=ddp"], ["--parallel=fsdp"]),
    (["--parallel=ddp", "--use_distributed_optimizer=true"], ["--parallel=fsdp", "--use_distributed_optimizer=false"]),
    (["--parallel=fsdp"], ["--parallel=ddp"]),
    (["--parallel=ddp", "--use_distributed_optimizer=true", "--optimizer=muon"],
     ["--parallel=fsdp", "--use_distributed_optimizer=false", "--optimizer=muon"]),
    (["--parallel=fsdp", "--optimizer=muon"], ["--parallel=ddp", "--optimizer=muon"]),
], ids=["ddp-to-fsdp", "zero-to-fsdp", "fsdp-to-ddp", "muon-zero-to-fsdp", "muon-fsdp-to-ddp"])
def test_resume_across_engines_continues_the_run(tiny_pretrain_run_args, tmp_path, first, then):
    args = [a if not a.startswith("--batch_size") else "--batch_size=2" for a in tiny_pretrain_run_args]
    args += ["--gradient_accumulation_steps=2", "--max_iters=6"]
    ref, other, run = tmp_path / "ref", tmp_path / "other", tmp_path / "run"
    run_cmd(train_cmd([*args, *first, f"--out_dir={ref}"], NPROC), env=_env())      # uninterrupted, saving engine
    run_cmd(train_cmd([*args, *then, f"--out_dir={other}"], NPROC), env=_env())     # uninterrupted, resuming engine
    run_cmd(train_cmd([*args, *first, f"--out_dir={run}", "--max_iters=3"], NPROC), env=_env())  # saves step 3
    out = run_cmd(train_cmd([f"--out_dir={run}", "--init_from=resume", "--max_iters=6", *then], NPROC),
                  env=_env()).stdout
    engine = then[0].split("=")[1]
    assert f"exp_avg, exp_avg_sq and step, Muon's momentum, per parameter) converted to --parallel={engine}" in out, \
        out[-3000:]
    assert "FRESH AdamW moments" not in out
    a, b, r = losses(ref), losses(other), losses(run)
    assert sorted(r) == sorted(a) == [1, 2, 3, 4, 5, 6]
    assert all(r[s] == a[s] for s in (1, 2, 3))  # before the resume: the same engine, the same run
    # The two engines train the same model on the same global batch; only the order of their sums differs.
    # That disagreement over the whole uninterrupted run is the noise a converted resume may add.
    noise = max(abs(a[s] - b[s]) for s in a)
    assert noise <= 1e-4 * max(abs(v) for v in a.values()), (a, b)  # the engines agree (else the bound is void)
    tol = 4 * noise + 1e-6 * abs(a[6])
    for s in (4, 5, 6):  # 5 and 6 follow optimizer steps taken with the converted moments
        assert abs(r[s] - a[s]) <= tol, (s, r[s], a[s], tol)
    # the bound is tight: one optimizer step moves the loss by far more than it (a restart of the moments,
    # whose first AdamW step moves every weight by about lr, would not stay inside it)
    assert abs(a[6] - a[5]) > 10 * tol, (a, tol)
    # the checkpoints written after the resume are in the resuming engine's format, and verify
    step6 = dict(list_checkpoints(str(run)))[6]
    assert verify_checkpoint(step6) is None
    names = set(os.listdir(step6))
    assert (dcp_shard_file(0) in names) == (engine == "fsdp") and (MODEL_FILE in names) == (engine == "ddp"), names
