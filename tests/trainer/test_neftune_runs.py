"""--neftune_noise_alpha in the trainer (model/neftune.py; the noise itself: tests/model/test_neftune.py): an SFT
run with it, its resume, and the layouts and tasks that refuse it."""
from __future__ import annotations

import os

import pytest

from tests.conftest import ROOT, run_cmd, train_cmd


def _sft_args(tiny_pretrain_data, pretrained, out) -> list[str]:
    return [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=96", "--device=cpu",
            "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=2", "--eval_iters=2",
            "--warmup_iters=2", "--seed=3", "--val_ratio=0.05", "--task_type=sft",
            f"--data_dir={os.path.join(ROOT, 'data', 'sft')}", f"--init_from={pretrained['out']}", f"--out_dir={out}",
            "--max_iters=4", "--batch_size=4", "--learning_rate=3e-3", "--checkpoint_interval=2"]


def test_an_sft_run_with_noise_trains_differently_and_resumes_exactly(tiny_pretrain_data, pretrained,
                                                                      tmp_path):
    """--neftune_noise_alpha=5 on an SFT run: the first step's loss differs from the clean run's by a perturbation
    (the same weights and batch: the noise reached the training forward); a run stopped at step 2 and continued gives
    the uninterrupted noisy run's losses and validation loss (the generator's state is in the checkpoint)."""
    from utils.metrics import dedupe_by_step, read_metrics

    def rows(out):
        return dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    clean, noisy, resumed = tmp_path / "clean", tmp_path / "noisy", tmp_path / "resumed"
    run_cmd(train_cmd(_sft_args(tiny_pretrain_data, pretrained, clean)))
    log = run_cmd(train_cmd([*_sft_args(tiny_pretrain_data, pretrained, noisy), "--neftune_noise_alpha=5"])).stdout
    assert "[neftune] noise alpha 5 on the input embeddings" in log, log[-2000:]
    run_cmd(train_cmd([*_sft_args(tiny_pretrain_data, pretrained, resumed), "--neftune_noise_alpha=5",
                       "--max_iters=2"]))
    run_cmd(train_cmd([*_sft_args(tiny_pretrain_data, pretrained, resumed), "--neftune_noise_alpha=5"]))
    c, n, r = rows(clean), rows(noisy), rows(resumed)
    assert c[1]["loss"] != n[1]["loss"]  # the same weights and batch: only the noise differs
    assert abs(c[1]["loss"] - n[1]["loss"]) < 0.05 * c[1]["loss"]  # a perturbation, not another model
    assert [r[s]["loss"] for s in (1, 2, 3, 4)] == [n[s]["loss"] for s in (1, 2, 3, 4)]
    assert r[4]["val_loss"] == n[4]["val_loss"]


def test_noise_outside_supervised_training_or_over_split_embeddings_is_refused():
    from trainer.config import TrainConfig
    from trainer.validation import validate_config
    base = dict(data_dir="d", tokenizer_dir="t", device="cpu")
    validate_config(TrainConfig(**base, task_type="pretrain", neftune_noise_alpha=5), torch_free=True)
    for bad, words in ((dict(neftune_noise_alpha=-1), "--neftune_noise_alpha=-1: must be a finite number >= 0"),
                       (dict(neftune_noise_alpha=float("nan")), "--neftune_noise_alpha=nan: must be a finite number"),
                       (dict(neftune_noise_alpha=5, task_type="grpo"),
                        "--neftune_noise_alpha=5 is supervised training's (--task_type=sft or pretrain; TRL's "
                        "SFTTrainer), not --task_type=grpo's"),
                       (dict(neftune_noise_alpha=5, parallel="fsdp", tensor_parallel_size=2),
                        "--neftune_noise_alpha=5 cannot be combined with --tensor_parallel_size=2 yet"),
                       (dict(neftune_noise_alpha=5, context_parallel_size=2),
                        "--neftune_noise_alpha=5 cannot be combined with --context_parallel_size=2 yet")):
        with pytest.raises(Exception) as e:
            validate_config(TrainConfig(**base, **bad), torch_free=True)
        assert words in str(e.value), str(e.value)
