"""The trainer with --context_parallel_size (model/ring_attention.py): real 2-rank runs under torchrun against
one process, a resume across cp layouts (cp=2 -> 1 -> 2), a bit-exact resume after a SIGKILL, and the one-line
refusals. The numerics of the ring and of every gradient are tests/parallel/test_context_parallel.py's."""
from __future__ import annotations

import os

import torch

from tests.conftest import run_cmd, run_trainer
from tests.trainer.test_end_to_end import _env, final_weights, losses, train_cmd
from tests.trainer.test_tensor_parallel_runs import _one_line_error
from checkpoint.verify import find_latest_valid
from utils.metrics import dedupe_by_step, read_metrics


def test_cp2_follows_one_process_and_resumes_at_cp1_and_back(tiny_pretrain_run_args, tmp_path):
    """fp32, sequences of 32 split over 2 ranks (chunks of 8: 0+3 and 1+2): every step's loss follows the
    one-process run (only the summation order differs); its checkpoint resumes in one process (cp=1) and
    that one's at cp=2 again, every step still following the uninterrupted run."""
    args = [*tiny_pretrain_run_args, "--max_iters=6", "--lr_decay_iters=6", "--gradient_accumulation_steps=2",
            "--checkpoint_interval=2"]
    ref, run = tmp_path / "ref", tmp_path / "cp"
    run_cmd(train_cmd([*args, f"--out_dir={ref}"], 1), env=_env())
    proc = run_cmd(train_cmd([*args, f"--out_dir={run}", "--context_parallel_size=2", "--max_iters=2"], 2), env=_env())
    assert "context parallel 2" in proc.stdout and "data-parallel 1 x context 2" in proc.stdout, proc.stdout[-2000:]
    for nproc, cp, until in ((1, 1, 4), (2, 2, 6)):
        run_cmd(train_cmd([f"--out_dir={run}", "--init_from=resume", f"--max_iters={until}",
                           f"--context_parallel_size={cp}"], nproc), env=_env())
    a, b = losses(ref), losses(run)
    assert sorted(b) == [1, 2, 3, 4, 5, 6], b
    for s in a:
        assert abs(a[s] - b[s]) <= 1e-4 * abs(a[s]), (s, a[s], b[s])
    assert a[6] < a[1]  # it trains


def test_cp2_resumes_bit_exact_after_sigkill(tiny_pretrain_run_args, tmp_path):
    """SIGKILL in the middle of step 6's checkpoint save (step 3's is complete): the resumed cp=2 run gives the
    uninterrupted cp=2 run's losses and final weights bit for bit."""
    args = [*tiny_pretrain_run_args, "--max_iters=6", "--checkpoint_interval=3", "--context_parallel_size=2"]
    ref, killed = tmp_path / "ref", tmp_path / "killed"
    run_cmd(train_cmd([*args, f"--out_dir={ref}"], 2), env=_env())
    # no MYLLM_FAULT_ONCE_FILE: whichever rank created it first would own the fault, and only rank 0 writes the
    # model file where the hook fires; every rank arms it, rank 0 kills itself, torchrun ends the other
    proc = run_trainer(train_cmd([*args, f"--out_dir={killed}"], 2), env=_env(MYLLM_FAULT="kill_in_save@6"))
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert find_latest_valid(str(killed)).endswith("step_00000003")  # step 6's save never published
    run_cmd(train_cmd([*args, f"--out_dir={killed}", "--init_from=resume"], 2), env=_env())
    assert losses(killed) == losses(ref)  # bit-identical floats, steps 1..6
    a, b = final_weights(ref), final_weights(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sft_at_cp2_follows_one_process_padded_and_packed(pretrained, tiny_pretrain_data, tmp_path):
    """SFT at cp=2 (each row split over 2 ranks; the ring masks padding and, with --sft_packing, each packed
    conversation to itself) logs the one-process run's losses and validation loss; padded rows are padded to
    --max_seq_len there (whole chunks), to the longest row in one process, which the masks make no difference.
    (The bundled conversations are ~400-500 tokens of the tiny tokenizer: rows of 1024 pack 2-4 of them.)"""
    from tests.conftest import ROOT
    common = [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--device=cpu",
              "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=3", "--eval_iters=1",
              "--warmup_iters=1", "--seed=3", "--val_ratio=0.1", "--task_type=sft",
              f"--data_dir={os.path.join(ROOT, 'data', 'sft')}", f"--init_from={pretrained['out']}", "--max_iters=3",
              "--learning_rate=3e-3", "--checkpoint_interval=3"]
    for packing, shape in (("false", ["--max_seq_len=96", "--batch_size=4"]),
                           ("true", ["--max_seq_len=1024", "--batch_size=2"])):
        args = [*common, *shape, f"--sft_packing={packing}"]
        one, cp = tmp_path / f"one_{packing}", tmp_path / f"cp_{packing}"
        run_cmd(train_cmd([*args, f"--out_dir={one}"], 1), env=_env())
        run_cmd(train_cmd([*args, f"--out_dir={cp}", "--context_parallel_size=2"], 2), env=_env())
        a, b = losses(one), losses(cp)
        assert sorted(a) == sorted(b) == [1, 2, 3], (a, b)
        for s in a:
            assert abs(a[s] - b[s]) <= 1e-4 * abs(a[s]), (packing, s, a[s], b[s])
        va, vb = (dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl")))[3]["val_loss"] for d in (one, cp))
        assert abs(va - vb) <= 1e-4 * abs(va), (packing, va, vb)


def test_dpo_at_cp2_follows_one_process(pretrained, tiny_pretrain_data, tmp_path):
    """DPO at cp=2 (chosen and rejected rows split over 2 ranks, their per-token log-probabilities gathered into
    whole rows for the sequence sums; the reference model split the same way) logs the one-process run's losses
    and rewards."""
    from tests.conftest import toy_dpo_pairs
    toy = toy_dpo_pairs(tmp_path / "prefs.jsonl")
    args = [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=96", "--device=cpu",
            "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--eval_iters=1",
            "--warmup_iters=1", "--seed=3", "--val_ratio=0.05", "--task_type=dpo", f"--data_dir={toy}",
            f"--init_from={pretrained['out']}", "--max_iters=3", "--batch_size=4", "--learning_rate=3e-3",
            "--dpo_beta=0.5", "--checkpoint_interval=3"]
    one, cp = tmp_path / "one", tmp_path / "cp"
    run_cmd(train_cmd([*args, f"--out_dir={one}"], 1), env=_env())
    run_cmd(train_cmd([*args, f"--out_dir={cp}", "--context_parallel_size=2"], 2), env=_env())
    a, b = (dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))) for d in (one, cp))
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for s in a:
        for key in ("loss", "chosen_reward", "rejected_reward"):
            assert abs(a[s][key] - b[s][key]) <= 1e-4 * max(1.0, abs(a[s][key])), (s, key, a[s][key], b[s][key])
    assert a[3]["chosen_reward"] != 0.0  # the policy moved away from the reference


def test_cp_layouts_that_cannot_run_exit_2_with_one_line(tiny_pretrain_run_args, tmp_path):
    base = [*tiny_pretrain_run_args, "--max_iters=1", f"--out_dir={tmp_path / 'x'}"]
    line = _one_line_error([*base, "--context_parallel_size=2"])
    assert "world size 1 is not a multiple of" in line and "context 2" in line, line
    line = _one_line_error([*base, "--context_parallel_size=2", "--sample_every=1"])
    assert "--sample_every=1 cannot be combined with --context_parallel_size=2" in line, line
    assert not os.path.exists(tmp_path / "x" / "checkpoints")  # refused before anything ran
