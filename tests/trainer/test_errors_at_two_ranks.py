"""Errors at several ranks (issue 33 item 9): when one rank finds a damaged file, every rank prints the same
one line naming that file and exits with the same code (before, the others died with a gloo "Connection closed
by peer" traceback, or blamed their own intact file). Two gloo ranks, a tiny real run per engine made once
for the module (checkpoints at steps 1 and 2), each case damages a copy of step 2 and recomputes its
manifest (tests/trainer/test_damaged_checkpoints.republish), so that the reader itself must catch it.
"""
from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import child_env, run_trainer, train_cmd
from tests.trainer.test_damaged_checkpoints import _random_bytes, _truncate, fp16_moment, republish
from utils.constants import EXIT_BAD_CHECKPOINT, EXIT_OK

STEP = "step_00000002"


_env = child_env  # tests/conftest.py: one thread per process, unbuffered output


@pytest.fixture(scope="module")
def runs2(tiny_pretrain_run_args, tmp_path_factory) -> dict:
    """{"ddp": a ZeRO-1 run at 2 ranks (optimizer_rank0/1.pt), "fsdp": an FSDP run at 2 ranks, "pp": a 2-stage
    pipeline (stage0/1_*), "args"}."""
    base = tmp_path_factory.mktemp("two_ranks")
    out = {"args": tiny_pretrain_run_args}
    for kind, extra in (("ddp", ["--use_distributed_optimizer=true"]), ("fsdp", ["--parallel=fsdp"]),
                        ("pp", ["--pipeline_parallel_size=2", "--gradient_accumulation_steps=2"])):
        run = base / kind
        proc = run_trainer(train_cmd([*tiny_pretrain_run_args, f"--out_dir={run}", "--max_iters=2",
                                      "--checkpoint_interval=1", "--batch_size=2", *extra], nproc=2), env=_env())
        assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
        out[kind] = (run, extra)
    return out


def _resume(runs2, kind, damage, tmp_path):
    src, extra = runs2[kind]
    run = tmp_path / "run"
    shutil.copytree(src, run)
    step = run / "checkpoints" / STEP
    damage(step)
    republish(step)
    return run_trainer(train_cmd([*runs2["args"], f"--out_dir={run}", "--max_iters=3", "--checkpoint_interval=1",
                                  "--batch_size=2", "--init_from=resume", *extra], nproc=2), env=_env())


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "] error:" in line]


CASES = [
    ("extra_rank1_truncated", "ddp", lambda d: _truncate(d / "extra_rank1.pt"), "extra_rank1.pt"),
    ("optimizer_rank1_truncated", "ddp", lambda d: _truncate(d / "optimizer_rank1.pt"), "optimizer_rank1.pt"),
    ("extra_rank1_rng_broken", "fsdp",
     lambda d: torch.save({"rng": {"torch_cpu": torch.zeros(3, dtype=torch.uint8)}}, d / "extra_rank1.pt"),
     "extra_rank1.pt"),
    ("optimizer_rank1_fp16", "ddp", lambda d: fp16_moment(d / "optimizer_rank1.pt"), "optimizer_rank1.pt"),
    ("distcp_rank1_random", "fsdp", lambda d: _random_bytes(d / "__1_0.distcp"), "__1_0.distcp"),
    ("stage1_model_random", "pp", lambda d: _random_bytes(d / "stage1_model.safetensors"), "stage1_model.safetensors"),
    ("stage1_model_truncated", "pp", lambda d: _truncate(d / "stage1_model.safetensors"), "stage1_model.safetensors"),
    ("stage1_optimizer_fp16", "pp", lambda d: fp16_moment(d / "stage1_optimizer_dp0.pt"), "stage1_optimizer_dp0.pt"),
    ("stage1_extra_truncated", "pp", lambda d: _truncate(d / "extra_rank1.pt"), "extra_rank1.pt"),
]


@pytest.mark.parametrize("kind, damage, needle", [pytest.param(k, d, n, id=i) for i, k, d, n in CASES])
def test_a_damaged_file_at_one_rank_is_the_same_line_at_every_rank(runs2, tmp_path, kind, damage, needle):
    proc = _resume(runs2, kind, damage, tmp_path)
    err = proc.stderr
    assert "Traceback" not in err and "Connection closed" not in err, err[-4000:]
    assert proc.returncode == EXIT_BAD_CHECKPOINT, (proc.returncode, err[-4000:])
    lines = _error_lines(err)
    assert sorted(line.split("] error:")[0] for line in lines) == ["[rank 0", "[rank 1"], err[-4000:]
    texts = {line.split("] error:", 1)[1] for line in lines}
    assert len(texts) == 1, lines  # the same line, naming the damaged file
    assert needle in texts.pop(), lines


@pytest.mark.parametrize("text", ['{"format": 1, "pp_size": null}', "[2, 2]", "{"])
def test_a_damaged_pipeline_json_is_a_damaged_checkpoint(tiny_pretrain_run_args, tmp_path, text):
    """pipeline.json is verified like the other sidecars: damaged in every checkpoint (manifest recomputed),
    resume is exit 5 at both ranks naming it (it was exit 2, 'pp=None x dp=None'); --init_from=<that
    checkpoint> likewise."""
    run = tmp_path / "pp"
    args = [*tiny_pretrain_run_args, "--max_iters=2", "--checkpoint_interval=1", "--batch_size=2",
            "--gradient_accumulation_steps=2", "--pipeline_parallel_size=2"]
    proc = run_trainer(train_cmd([*args, f"--out_dir={run}"], nproc=2), env=_env())
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    steps = sorted((run / "checkpoints").iterdir())
    assert [s.name for s in steps] == ["step_00000001", STEP]
    for step in steps:
        (step / "pipeline.json").write_text(text)
        republish(step)
    proc = run_trainer(train_cmd([*args, f"--out_dir={run}", "--init_from=resume", "--max_iters=3"], nproc=2),
                       env=_env())
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert proc.returncode == EXIT_BAD_CHECKPOINT, (proc.returncode, proc.stderr[-3000:])
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("[checkpoint] skipping")]
    assert len(skipped) == 2 and all("pipeline.json" in line for line in skipped), proc.stdout[-3000:]
    assert len({line.split("] error:", 1)[1] for line in _error_lines(proc.stderr)}) == 1, proc.stderr[-3000:]
    proc = run_trainer(train_cmd([*args, f"--out_dir={tmp_path / 'new'}", f"--init_from={steps[1]}"], nproc=2),
                       env=_env())
    assert proc.returncode == EXIT_BAD_CHECKPOINT, (proc.returncode, proc.stderr[-3000:])
    assert all("pipeline.json" in line for line in _error_lines(proc.stderr)), proc.stderr[-3000:]
