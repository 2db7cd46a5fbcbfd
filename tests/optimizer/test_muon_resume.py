"""--optimizer=muon through train_my_ddp.py: a run killed mid-way resumes bit for bit (its Muon momentum is in
the checkpoint), at 2 ranks under ZeRO-1 too, and switching --optimizer on resume is refused with exit 2."""
from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import child_env, run_cmd, run_trainer, train_cmd
from checkpoint.files import load_model_state
from checkpoint.verify import find_latest_valid
from utils.constants import EXIT_BAD_CONFIG
from utils.metrics import dedupe_by_step, read_metrics

MUON = ["--optimizer=muon", "--muon_lr=2e-2", "--muon_weight_decay=0.05"]


def losses(out_dir) -> dict[int, float]:
    return {s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(out_dir, "metrics.jsonl"))).items()}


@pytest.mark.parametrize("nproc, extra", [(1, []), (2, ["--use_distributed_optimizer=true", "--zero_stage=2"]),
                                         (2, ["--parallel=fsdp"]),
                                         (2, ["--pipeline_parallel_size=2", "--gradient_accumulation_steps=2"])],
                         ids=["1proc", "2proc-zero2", "2proc-fsdp", "2proc-pp"])
def test_muon_resume_after_a_kill_is_exact_and_a_switch_is_refused(tiny_pretrain_run_args, tmp_path, nproc, extra):
    args = [*tiny_pretrain_run_args, *MUON, *extra, "--max_iters=6", "--bucket_size=20000"]
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    started = run_cmd(train_cmd([*args, f"--out_dir={ref}"], nproc), env=child_env())
    assert "[optimizer] muon on the blocks' 2-D matrices (lr 0.02" in started.stdout, started.stdout[-2000:]
    once = tmp_path / "fired"
    proc = run_trainer(train_cmd([*args, f"--out_dir={crashed}"], nproc),
                       env=child_env(MYLLM_FAULT="crash@5", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert proc.returncode != 0 and once.exists() and max(losses(crashed)) == 4
    if nproc == 1:  # the refusal is decided from the saved config before any engine loads (trainer/start.py)
        switched = run_trainer(train_cmd([*args, "--optimizer=adamw", f"--out_dir={crashed}", "--init_from=resume"]),
                               env=child_env())
        assert switched.returncode == EXIT_BAD_CONFIG, switched.stderr[-1500:]
        assert "switching the optimizer on resume is refused" in switched.stdout + switched.stderr
    run_cmd(train_cmd([*args, f"--out_dir={crashed}", "--init_from=resume"], nproc), env=child_env())
    assert losses(crashed) == losses(ref)  # bit-identical floats, steps 1..6
    if nproc == 1 or "--zero_stage=2" in extra:  # (FSDP's DCP and the pipeline's per-stage checkpoints are
        # other formats: their losses 4..6 above depend on the restored momentum already)
        a = load_model_state(find_latest_valid(str(ref)))
        b = load_model_state(find_latest_valid(str(crashed)))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if nproc == 1:  # an unknown --optimizer is a configuration error (exit 2) naming the choices
        bad = run_trainer(train_cmd([*args, "--optimizer=sgd", f"--out_dir={tmp_path / 'bad'}"]), env=child_env())
        assert bad.returncode == EXIT_BAD_CONFIG and "--optimizer='sgd' (adamw | muon)" in bad.stdout + bad.stderr
    if nproc == 1:  # Muon really ran: its losses are not AdamW's
        adamw = tmp_path / "adamw"
        run_cmd(train_cmd([*tiny_pretrain_run_args, "--max_iters=6", f"--out_dir={adamw}"]), env=child_env())
        assert losses(adamw)[6] != losses(ref)[6]


# Across world sizes: the topology test of tests/trainer (three runs: uninterrupted A, B from scratch at the
# new layout for the drift, A's step-3 checkpoint resumed at B's layout), with Muon: its momentum re-sharded
# by the optimizer state dict (ZeRO) and by DCP (FSDP)
ACROSS = [
    ("muon-zero2-1to2", (1, ["--batch_size=4", "--gradient_accumulation_steps=2", "--use_distributed_optimizer=true",
                             "--zero_stage=2", *MUON]),
     (2, ["--batch_size=4", "--gradient_accumulation_steps=1", "--use_distributed_optimizer=true", "--zero_stage=2",
          *MUON])),
    ("muon-fsdp-2to1", (2, ["--batch_size=2", "--gradient_accumulation_steps=2", "--parallel=fsdp", *MUON]),
     (1, ["--batch_size=4", "--gradient_accumulation_steps=2", "--parallel=fsdp", *MUON])),
]


@pytest.mark.parametrize("name,before,after", ACROSS, ids=[c[0] for c in ACROSS])
def test_muon_resume_at_another_world_size(tiny_pretrain_run_args, tmp_path, name, before, after):
    from tests.trainer.test_resume_topology import test_resume_at_another_layout_follows_the_uninterrupted_run as run
    run(tiny_pretrain_run_args, tmp_path, name, before, after)
