"""Preference-loss variants. BCO (Jung et al. 2024): DPO's bco_pair loss (TRL's DPOTrainer loss_type="bco_pair") and
KTO's bco (TRL's BCOTrainer on unpaired examples): the formulas on hand values in Python floats, the running mean
against TRL's RunningMoments update written out in Python floats, and runs: each step's loss is the formula of the
rewards the run logged with the running mean over its steps, a crash and resume continue the running mean exactly, and
two ranks give one process accumulating the same micro-batches. DPO's weighted sums of losses (MPO) and LD-DPO's
length-desensitised log-probabilities against the formulas."""
from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch

from tests.conftest import run_cmd, run_trainer, toy_dpo_pairs, train_cmd
from tests.trainer.test_end_to_end import _env
from utils.metrics import dedupe_by_step, read_metrics


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x > -30 else x


def _bco(a: float, b: float, delta: float) -> float:
    return -_logsig(a - delta) - _logsig(-(b - delta))


def test_the_loss_is_bco_of_the_rewards_shifted_by_delta():
    from trainer.tasks.dpo import dpo_loss
    pc, pr, rc, rr = (torch.tensor(v, dtype=torch.float64) for v in
                      ([-3.0, -5.5, -2.0], [-4.0, -5.0, -7.0], [-3.5, -5.0, -2.5], [-3.0, -6.0, -6.0]))
    beta, delta = 0.5, 0.125
    losses, ch, rj = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="bco_pair", bco_delta=delta)
    for i in range(3):
        a, b = beta * float(pc[i] - rc[i]), beta * float(pr[i] - rr[i])
        assert abs(float(losses[i]) - _bco(a, b, delta)) < 1e-12
        assert float(ch[i]) == a and float(rj[i]) == b


def test_the_running_mean_is_trls_running_moments_at_one_process():
    """TRL's RunningMoments (mean 0, var 1, count 1e-24; each call adds one batch mean: delta = x - mean, count + 1,
    mean += delta / count) fed each micro-batch's mean reward, one micro-batch a step: the same delta as ours, which
    adds the micro-batch's own rewards to the sums of the steps before."""
    from trainer.tasks.bco import BCORunningMean
    g = torch.Generator().manual_seed(0)
    ours = BCORunningMean(("chosen_reward", "rejected_reward"), 0.5)
    mean, var, count = 0.0, 1.0, 1e-24
    for step in range(6):
        rewards = torch.randn(4, generator=g, dtype=torch.float64) * (step + 1)  # (a + b) / 2 of 4 pairs
        x = float(rewards.mean())
        d, tot = x - mean, count + 1
        old_sum = var * count + d * d * count * 1 / tot
        mean += d * 1 / tot
        var, count = old_sum / tot, tot
        got = ours.delta(rewards.sum(), len(rewards))
        assert abs(float(got) - mean) < 1e-12 * max(1.0, abs(mean)), (step, float(got), mean)
        ours.update(rewards.sum(), len(rewards))
    # a step whose rewards are not finite is left out; the state round-trips through JSON numbers
    state = ours.state_dict()
    ours.update(torch.tensor(float("nan"), dtype=torch.float64), 4)
    assert ours.state_dict() == state and state["count"] == 24
    again = BCORunningMean(("chosen_reward", "rejected_reward"), 0.5)
    again.load_state_dict(state, "here")
    assert float(again.delta(torch.tensor(1.0, dtype=torch.float64), 1)) == float(
        ours.delta(torch.tensor(1.0, dtype=torch.float64), 1))
    from trainer.config import TrainingError
    for bad in ({"reward_sum": "x", "count": 1}, {"count": 1}, {"reward_sum": 1.0, "count": -1}):
        with pytest.raises(TrainingError, match="here: task.bco"):
            again.load_state_dict(bad, "here")


def _args(tiny_pretrain_data, toy, init, out, *extra):
    return [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=96", "--device=cpu",
            "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--warmup_iters=1",
            "--seed=3", "--val_ratio=0.0", "--task_type=dpo", "--dpo_loss=bco_pair", "--dpo_beta=0.5",
            f"--data_dir={toy}", f"--init_from={init}", f"--out_dir={out}", "--learning_rate=3e-3", *extra]


def test_each_steps_loss_is_bco_with_the_running_mean_of_the_rewards_logged(pretrained, tiny_pretrain_data,
                                                                           tmp_path):
    """One pair a step: step s's loss is bco of its logged rewards a_s, b_s with delta = the mean of (a_t + b_t) / 2
    over steps 1..s (step 1: policy = reference, every reward 0, loss 2 log 2); a crash at step 4 resumes from step
    2's checkpoint and logs the uninterrupted run's rows."""
    toy = toy_dpo_pairs(tmp_path / "toy.jsonl", 8)
    whole = tmp_path / "whole"
    common = ["--max_iters=5", "--batch_size=1", "--checkpoint_interval=2"]
    run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], whole, *common)), env=_env())
    recs = dedupe_by_step(read_metrics(os.path.join(whole, "metrics.jsonl")))
    assert sorted(recs) == [1, 2, 3, 4, 5]
    halves = []
    for s in range(1, 6):
        a, b = recs[s]["chosen_reward"], recs[s]["rejected_reward"]
        halves.append((a + b) / 2)
        want = _bco(a, b, sum(halves) / len(halves))
        assert abs(recs[s]["loss"] - want) < 1e-5 * max(1.0, want), (s, recs[s], want)
    assert abs(recs[1]["loss"] - 2 * math.log(2)) < 1e-6 and any(abs(h) > 1e-3 for h in halves[1:])
    from checkpoint.verify import find_latest_valid
    state = json.loads(open(os.path.join(find_latest_valid(str(whole)), "trainer_state.json")).read())
    assert state["task"]["bco"]["count"] == 5.0  # the final checkpoint: the pairs of 5 steps
    once, crashed = tmp_path / "once", tmp_path / "crashed"
    proc = run_trainer(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], crashed, *common)),
                       env=_env(MYLLM_FAULT="crash@4", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert proc.returncode != 0 and once.exists()
    run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], crashed, *common, "--init_from=resume")),
            env=_env())
    again = dedupe_by_step(read_metrics(os.path.join(crashed, "metrics.jsonl")))
    for s in (3, 4, 5):
        assert again[s]["loss"] == recs[s]["loss"] and again[s]["chosen_reward"] == recs[s]["chosen_reward"], s


@pytest.mark.parametrize("layout", ["ddp", "pp2"])
def test_two_ranks_follow_one_process(pretrained, tiny_pretrain_data, tmp_path, layout):
    """2 data-parallel ranks of one pair each, or 2 pipeline stages running the same two micro-batches (the loss on the
    last stage), against one process accumulating them: the same steps (to fp32 summation order): each micro-batch's
    delta counts its own pair and every earlier step's pairs, not the other micro-batch's."""
    toy = toy_dpo_pairs(tmp_path / "toy.jsonl", 12)
    common = ["--max_iters=4", "--batch_size=1", "--checkpoint_interval=100"]
    one, two = tmp_path / "one", tmp_path / layout
    run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], one, *common,
                            "--gradient_accumulation_steps=2")), env=_env())
    extra = ["--pipeline_parallel_size=2", "--gradient_accumulation_steps=2"] if layout == "pp2" else []
    run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], two, *common, *extra), 2), env=_env())
    a, b = (dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))) for d in (one, two))
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in a:
        for key in ("loss", "chosen_reward", "rejected_reward"):
            assert abs(a[s][key] - b[s][key]) <= 1e-5 * max(1.0, abs(a[s][key])), (s, key, a[s][key], b[s][key])


def test_mpo_sums_its_terms_with_their_weights():
    """--dpo_loss=sigmoid,bco_pair,sft --dpo_loss_weights=0.8,0.2,1 (MPO): the micro-batch loss is the weighted sum of
    each loss computed alone (sft: the chosen reply's per-token NLL per pair); the flags are checked in one line."""
    from trainer.config import TrainConfig
    from trainer.tasks.dpo import DPOTask
    from trainer.tasks.dpo_terms import dpo_loss_terms
    torch.manual_seed(0)
    from model import ModelConfig, Transformer
    model = Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, multiple_of=16, max_seq_len=16))
    ref = Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, multiple_of=16, max_seq_len=16))
    g = torch.Generator().manual_seed(1)
    batch = {}
    for side in ("chosen", "rejected"):
        x = torch.randint(0, 32, (3, 9), generator=g)
        y = torch.randint(0, 32, (3, 9), generator=g)
        y[:, :3] = -100
        batch.update({f"{side}_input_ids": x, f"{side}_labels": y})
    cpu = torch.device("cpu")

    def loss_of(loss: str, weights: str = "") -> float:
        cfg = TrainConfig(task_type="dpo", dpo_loss=loss, dpo_loss_weights=weights, dpo_beta=0.5)
        return float(DPOTask(cfg).micro_batch_loss(model, ref, batch, cpu)[0].detach())
    with torch.no_grad():
        nll = sum(float(model(batch["chosen_input_ids"][i:i + 1], labels=batch["chosen_labels"][i:i + 1]))
                  for i in range(3))  # each pair's mean per-token NLL
    assert abs(loss_of("sft") - nll) < 1e-5
    want = 0.8 * loss_of("sigmoid") + 0.2 * loss_of("bco_pair") + 1.0 * nll
    assert abs(loss_of("sigmoid,bco_pair,sft", "0.8,0.2,1") - want) < 1e-5
    assert abs(loss_of("sigmoid,sft") - (loss_of("sigmoid") + nll)) < 1e-5
    assert dpo_loss_terms("ipo") == [("ipo", 1.0)]
    for loss, weights, msg in (("sigmoid,simpo", "", "reference-free"), ("sigmoid,bogus", "", "'bogus' is not one"),
                               ("sigmoid,sigmoid", "", "named twice"), ("sigmoid,sft", "1", "one per --dpo_loss"),
                               ("sigmoid,sft", "1,nan", "finite")):
        with pytest.raises(ValueError, match=msg):
            dpo_loss_terms(loss, weights)
    from trainer.config import TrainingError
    from trainer.validation import validate_config
    with pytest.raises(TrainingError, match="--dpo_loss='sigmoid,orpo': simpo and orpo are reference-free"):
        validate_config(TrainConfig(task_type="dpo", data_dir="x", tokenizer_dir="y", init_from="z",
                                    dpo_loss="sigmoid,orpo"))


def test_kto_bco_is_bco_of_each_example_with_the_running_mean(pretrained, tiny_pretrain_data, tmp_path):
    """--task_type=kto --kto_loss=bco on DPO pairs (a desirable and an undesirable example each), one pair a step:
    the formula on hand values, and step s's loss the mean of -log sigma(a_s - delta) and -log sigma(delta - b_s) of
    its logged rewards, delta the mean of the rewards of every example of steps 1..s."""
    from trainer.tasks.kto import kto_loss
    policy, ref = torch.tensor([-3.0, -5.0], dtype=torch.float64), torch.tensor([-4.0, -4.5], dtype=torch.float64)
    losses, _ = kto_loss(policy, ref, torch.tensor([True, False]), torch.zeros(()), beta=0.5, loss_type="bco",
                         bco_delta=0.2)
    assert abs(float(losses[0]) + _logsig(0.5 - 0.2)) < 1e-12 and abs(float(losses[1]) + _logsig(0.2 + 0.25)) < 1e-12
    toy = toy_dpo_pairs(tmp_path / "toy.jsonl", 8)
    out = tmp_path / "kto"
    args = [a for a in _args(tiny_pretrain_data, toy, pretrained["out"], out, "--max_iters=4", "--batch_size=1",
                             "--checkpoint_interval=100") if not a.startswith(("--task_type", "--dpo_loss"))]
    run_cmd(train_cmd([*args, "--task_type=kto", "--kto_loss=bco"]), env=_env())
    recs = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    assert sorted(recs) == [1, 2, 3, 4]
    seen = []
    for s in range(1, 5):
        a, b = recs[s]["desirable_reward"], recs[s]["undesirable_reward"]
        seen += [a, b]
        delta = sum(seen) / len(seen)
        want = (-_logsig(a - delta) - _logsig(delta - b)) / 2
        assert abs(recs[s]["loss"] - want) < 1e-5 * max(1.0, want), (s, recs[s], want)
    assert any(abs(x) > 1e-3 for x in seen)


def test_ld_dpo_weighs_the_policys_tokens_past_the_shorter_reply():
    """--ld_alpha (LD-DPO): the loss is sigmoid DPO of the policy's reply log-probabilities with every token past the
    shorter reply's length (counted from each reply's first labelled token) x alpha, the reference's whole; alpha 1 is
    plain DPO; the flag is checked in one line."""
    from trainer.config import TrainConfig, TrainingError
    from trainer.tasks.dpo import DPOTask
    from trainer.validation import validate_config
    from model import ModelConfig, Transformer
    torch.manual_seed(0)
    model, ref = (Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, multiple_of=16,
                                          max_seq_len=16)) for _ in range(2))
    g = torch.Generator().manual_seed(2)
    batch = {}
    starts, ends = {"chosen": (3, 9), "rejected": (2, 6)}, {}  # replies of 6 and 4 labelled tokens
    for side, (a, b) in starts.items():
        x = torch.randint(0, 32, (2, 10), generator=g)
        y = torch.randint(0, 32, (2, 10), generator=g)
        y[:, :a], y[:, b:] = -100, -100
        batch.update({f"{side}_input_ids": x, f"{side}_labels": y})
        ends[side] = b - a
    cpu = torch.device("cpu")

    def token_logps(m, side):
        with torch.no_grad():
            nll = m(batch[f"{side}_input_ids"], labels=batch[f"{side}_labels"], reduction="none")
        return -nll.double()

    alpha, beta = 0.3, 0.5
    public = min(ends.values())
    lp = {}
    for side, (a, _) in starts.items():
        t = token_logps(model, side)
        lp[side] = t[:, a:a + public].sum(-1) + alpha * t[:, a + public:].sum(-1)  # the reply: from its first label
    rc, rr = (token_logps(ref, s).sum(-1) for s in ("chosen", "rejected"))
    h = (lp["chosen"] - lp["rejected"]) - (rc - rr)
    want = float(-torch.nn.functional.logsigmoid(beta * h).sum())

    def loss_of(a: float) -> float:
        cfg = TrainConfig(task_type="dpo", dpo_beta=beta, ld_alpha=a)
        return float(DPOTask(cfg).micro_batch_loss(model, ref, batch, cpu)[0].detach())
    assert abs(loss_of(alpha) - want) < 1e-5 and abs(loss_of(1.0) - want) > 1e-3
    for bad, said in ((dict(ld_alpha=1.5), "--ld_alpha=1.5: must be in [0, 1]"),
                      (dict(ld_alpha=0.5, dpo_loss="simpo"), "--ld_alpha: --dpo_loss=simpo is reference-free")):
        with pytest.raises(TrainingError, match=re.escape(said)):
            validate_config(TrainConfig(task_type="dpo", data_dir="x", tokenizer_dir="y", init_from="z", **bad))
