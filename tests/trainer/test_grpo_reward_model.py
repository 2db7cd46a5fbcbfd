"""GRPO scored by a reward model (--reward_model): a rollout's rewards are the reward model's scores of its training rows
(prompt + completion through the stop token) computed apart, a run logs them (and its held-out answers' scores), and a
language model or a reward model with another tokenizer is refused in one line."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.conftest import child_env, run_cmd, run_trainer, train_cmd
from tests.trainer.test_grpo_runs import _args, _rows
from tests.trainer.test_reward import _args as reward_args
from tests.trainer.test_reward import _toy


@pytest.fixture(scope="module")
def reward_model(pretrained, tiny_pretrain_data, tmp_path_factory):
    """A 4-step reward run from the suite's pretrained model (the same tokenizer as the GRPO policy)."""
    tmp = tmp_path_factory.mktemp("grpo_rm")
    out = tmp / "rm"
    run_cmd(train_cmd(reward_args(tiny_pretrain_data, _toy(tmp, 8), pretrained["out"], out, "--max_iters=4",
                                  "--batch_size=4", "--checkpoint_interval=4")), env=child_env())
    return out


def _grpo(pretrained, tmp_path, rm, *extra):
    args = [a for a in _args(pretrained, tmp_path, *extra) if not a.startswith("--reward_fn=")]
    return args + [f"--reward_model={rm}"]


def _rollout(pretrained, tmp_path, rm):
    """GRPOTask's rollout of two prompts (4 completions each) scored by `rm` alone: (the task, its rows, the prompts)."""
    from trainer.config import TrainConfig
    from trainer.tasks.grpo import GRPOTask
    from trainer.weights import load_weights_from
    from utils.configurator import parse_config
    task = GRPOTask(parse_config(TrainConfig(), _grpo(pretrained, tmp_path, rm)))
    data = task.datasets({}, 0.0, False, None)
    task._load_tools(torch.device("cpu"))
    policy, _ = load_weights_from(str(pretrained["out"]), lambda m: None)
    batch = data.collate([0, 5])
    return task, task._roll(policy.eval(), torch.device("cpu"), batch, 0, []), batch["prompts"]


def test_rollout_rewards_are_the_reward_models_scores_of_the_rows(pretrained, reward_model, tmp_path):
    """With the run's tokenizer: every row's reward is what the reward model gives the row's real tokens (its
    attention mask: prompt + completion through the stop token), scored here one row at a time from the training
    rows' layout, not the scorer's own batches."""
    from model.score_head import last_token_scores
    from trainer.weights import load_weights_from
    _, rows, _ = _rollout(pretrained, tmp_path, reward_model)
    rm, _ = load_weights_from(str(reward_model), lambda m: None)
    with torch.no_grad():
        want = torch.stack([last_token_scores(rm.eval(), rows["input_ids"][i:i + 1],
                                              rows["attention_mask"][i:i + 1])[0, 0] for i in range(8)])
    assert rows["reward"].shape == (8,) and torch.allclose(rows["reward"].float(), want, atol=1e-5), \
        (rows["reward"], want)
    assert float(want.std()) > 0  # the completions score differently: the advantages are not all 0


def test_a_grpo_run_logs_the_reward_models_scores(pretrained, reward_model, tmp_path):
    out = tmp_path / "run"
    run_cmd(train_cmd(_grpo(pretrained, tmp_path, reward_model, "--max_iters=2", f"--out_dir={out}",
                            f"--eval_data_dir={tmp_path / 'prompts.jsonl'}", "--eval_interval=2")), env=child_env())
    rows = _rows(out)
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert r["reward"] == r["reward_reward_model"] and r["reward_std"] > 0
    assert rows[2]["val_reward"] == rows[2]["val_reward_reward_model"] and rows[2]["val_prompts"] == 12


def test_another_tokenizer_scores_the_text_and_a_language_model_is_refused(pretrained, reward_model, tmp_path):
    """A reward model exported with a tokenizer whose vocabulary differs from the run's (two pieces' ids swapped):
    each row's reward is transformers' AutoModelForSequenceClassification score of its own tokenizer's encoding of
    prompt + completion text. --reward_model=<a language model>: one line, exit 2."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    hf = tmp_path / "rm_hf"
    run_cmd([sys.executable, "export_hf.py", f"--ckpt={reward_model}", f"--out_dir={hf}"])
    (hf / "tokenizer_meta.json").unlink()
    tj = json.loads((hf / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    a, b = AutoTokenizer.from_pretrained(hf).tokenize(" plus 1")[:2]  # pieces every prompt holds
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (hf / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    task, rows, prompts = _rollout(pretrained, tmp_path, hf)
    tok, model = AutoTokenizer.from_pretrained(hf), AutoModelForSequenceClassification.from_pretrained(hf).eval()
    want = []
    for i in range(8):
        p = prompts[i // 4]
        done = rows["input_ids"][i, len(p.ids):int(rows["attention_mask"][i].sum())].tolist()
        text = task._tok.decode([t for t in done if t not in task._stop_ids], skip_special_tokens=True)
        with torch.no_grad():
            want.append(float(model(**tok(p.text + text, return_tensors="pt")).logits[0, 0]))
    assert torch.allclose(rows["reward"].float(), torch.tensor(want), atol=1e-5), (rows["reward"], want)
    from model.score_head import last_token_scores
    with torch.no_grad():  # (the run's own ids would have scored otherwise: the text path is what ran)
        ids = last_token_scores(task._rewards.fns[0].model, rows["input_ids"], rows["attention_mask"])[:, 0]
    assert (ids - torch.tensor(want)).abs().max() > 1e-3
    r = run_trainer(train_cmd(_grpo(pretrained, tmp_path, pretrained["out"], "--max_iters=1",
                                    f"--out_dir={tmp_path / 'a'}")), env=child_env())
    assert r.returncode == 2 and "a language model (no score head); a reward model" in r.stderr, r.stderr[-2000:]
