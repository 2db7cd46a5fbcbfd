"""The trainer with --tensor_parallel_size / --dp_replicate_size (parallel/mesh.py): real runs under
torchrun, a resume at another tensor / data-parallel split, and the one-line errors of layouts that
cannot run. The engine-level numerics (every layout against one process) are tests/parallel/test_tensor_parallel.py's."""
from __future__ import annotations


from tests.conftest import run_cmd, run_trainer
from tests.trainer.test_end_to_end import _env, losses, train_cmd
from utils.constants import EXIT_BAD_CONFIG


def test_tp2_trains_like_one_process_and_resumes_at_one_process_and_back(tiny_pretrain_run_args, tmp_path):
    """fp32: 2 tensor-parallel ranks (one data-parallel rank reading the whole batch) follow the one-process
    run step for step (only summation order differs); their checkpoint resumes in one process (tp=1 x dp=1,
    DCP reshards weights and Adam moments), and that one's checkpoint resumes at tp=2 again: every step
    follows the uninterrupted run."""
    # the schedule spans 6 steps in every part (by default it would end at each part's --max_iters)
    args = [*tiny_pretrain_run_args, "--max_iters=6", "--lr_decay_iters=6", "--gradient_accumulation_steps=2",
            "--checkpoint_interval=2"]
    ref, run = tmp_path / "ref", tmp_path / "tp"
    run_cmd(train_cmd([*args, f"--out_dir={ref}"], 1), env=_env())
    proc = run_cmd(train_cmd([*args, f"--out_dir={run}", "--parallel=fsdp", "--tensor_parallel_size=2",
                              "--max_iters=2"], 2), env=_env())
    assert "tensor parallel 2" in proc.stdout and "world 2 = pipeline 1 x data-parallel 1 x tensor 2" in proc.stdout, \
        proc.stdout[-2000:]
    for nproc, tp, until in ((1, 1, 4), (2, 2, 6)):
        run_cmd(train_cmd([f"--out_dir={run}", "--init_from=resume", f"--max_iters={until}",
                           f"--tensor_parallel_size={tp}"], nproc), env=_env())
    a, b = losses(ref), losses(run)
    assert sorted(b) == [1, 2, 3, 4, 5, 6], b
    for s in a:
        assert abs(a[s] - b[s]) <= 1e-4 * abs(a[s]), (s, a[s], b[s])


def _one_line_error(args: list[str]) -> str:
    proc = run_trainer(train_cmd(args, 1), env=_env())
    assert proc.returncode == EXIT_BAD_CONFIG, (proc.returncode, proc.stderr[-2000:])
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def test_layouts_that_cannot_run_exit_2_with_one_line(tiny_pretrain_run_args, tmp_path):
    base = [*tiny_pretrain_run_args, "--max_iters=1", f"--out_dir={tmp_path / 'x'}"]
    # --tensor_parallel_size alone implies --parallel=fsdp (issue 37 item 9); a world of 1 for 2 tensor ranks
    line = _one_line_error([*base, "--tensor_parallel_size=2"])
    assert "world size 1 is not a multiple of" in line and "tensor 2 = 2" in line, line
    line = _one_line_error([*base, "--parallel=ddp", "--tensor_parallel_size=2"])  # an explicit ddp is refused
    assert "needs --parallel=fsdp" in line, line
    line = _one_line_error([*base, "--parallel=fsdp", "--tensor_parallel_size=3"])
    assert "--n_heads=4 is not divisible by --tensor_parallel_size=3" in line, line
    line = _one_line_error([*base, "--parallel=fsdp", "--tensor_parallel_size=2", "--sequence_parallel=true",
                            "--dropout=0.1"])
    assert "--sequence_parallel=true cannot be combined with --dropout=0.1" in line, line


def test_dpo_with_lora_under_tp2_shards_reference_and_adapters_and_follows_one_process(pretrained, tiny_pretrain_data,
                                                                                      tmp_path):
    """DPO with LoRA adapters on every projection at --tensor_parallel_size=2 (policy, adapters and frozen
    reference all split over the tensor ranks, per-token log-probs from the vocabulary-parallel loss)
    gives one process's losses and rewards to fp32 summation noise."""
    from tests.trainer.test_day_to_day import _records, toy_dpo_args
    common = [*toy_dpo_args(tiny_pretrain_data, tmp_path, pretrained["out"], batch_size=4), "--lora_rank=4",
              "--lora_targets=all", "--learning_rate=3e-2"]
    run_cmd(train_cmd([*common, f"--out_dir={tmp_path / 'one'}"], 1), env=_env())
    log = run_cmd(train_cmd([*common, f"--out_dir={tmp_path / 'tp'}", "--parallel=fsdp", "--tensor_parallel_size=2"],
                            2), env=_env()).stdout
    assert "[dpo] reference model: sharded by FSDP2 and split over 2 tensor-parallel ranks" in log, log[-2000:]
    assert "[lora] rank 4 on all" in log, log[-2000:]
    one, tp = _records(tmp_path / "one"), _records(tmp_path / "tp")
    assert sorted(one) == sorted(tp) == [1, 2, 3]
    assert one[3]["chosen_reward"] != 0.0  # the adapters moved the policy away from the reference
    for s in (1, 2, 3):
        for key in ("loss", "chosen_reward", "rejected_reward"):
            a, b = one[s][key], tp[s][key]
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (s, key, a, b)
