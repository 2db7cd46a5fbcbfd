"""GRPO runs of train_my_ddp.py (--task_type=grpo) from the suite's tiny pretrained model: a run logs rewards,
lengths and the logprob parity, and writes its rollouts to samples.jsonl; one step at 2 gloo ranks equals one
process with the same global batch (same completions, same weights); a run stopped and resumed draws the same
completions and ends with the same weights, bit for bit; a reward that raises stops the run with one line."""
from __future__ import annotations

import json
import os

import torch

from tests.conftest import child_env, run_cmd, run_trainer, train_cmd
from tests.trainer.test_end_to_end import final_weights
from utils.metrics import dedupe_by_step, read_metrics

PROMPTS = [f"{a} plus {b} is" for a in range(1, 7) for b in range(1, 3)]


def _args(pretrained, tmp_path, *extra) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in PROMPTS), encoding="utf-8")
    d = dict(a.split("=", 1) for a in pretrained["args"] if a.startswith("--tokenizer_dir"))
    return [f"--init_from={pretrained['out']}", "--task_type=grpo", f"--data_dir={prompts}", *[f"{k}={v}" for k, v in d.items()],
            "--reward_funcs=", "--reward_fn=tests.trainer.grpo_toy_rewards:vowels", "--num_generations=4",
            "--max_prompt_length=12", "--max_completion_length=8", "--batch_size=2", "--learning_rate=1e-3",
            "--lr_schedule=constant", "--warmup_iters=0", "--eval_interval=0", "--log_interval=1", "--device=cpu",
            "--progress=false", "--peak_flops=1e11", "--seed=3", "--checkpoint_interval=2", "--threads=1", *extra]


def _rows(out) -> dict:
    return dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))


def test_grpo_run_logs_rewards_parity_and_samples(pretrained, tmp_path):
    out = tmp_path / "run"
    run_cmd(train_cmd(_args(pretrained, tmp_path, "--max_iters=3", f"--out_dir={out}",
                            "--generation_kv_cache=false")), env=child_env())
    rows = _rows(out)
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        assert 0 <= r["reward"] <= 1 and r["reward"] == r["reward_tests.trainer.grpo_toy_rewards.vowels"]
        assert 1 <= r["completion_length"] <= 8 and r["reward_std"] > 0 and r["entropy"] > 0
        assert r["logprob_diff_max"] == 0.0 and r["logprob_diff_mean"] == 0.0  # whole-row sampling: bit-equal
        assert r["clip_ratio"] == 0.0  # one update per rollout: the ratio is exactly 1
    samples = [json.loads(s) for s in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4 + [3] * 4
    assert all(s["prompt"] in PROMPTS and isinstance(s["reward"], float) for s in samples)
