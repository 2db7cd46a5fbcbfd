"""GRPO's loss (trainer/tasks/grpo_loss.py) against a direct, loop-by-loop implementation of the papers' formulas
in float64 on hand-made tensors (DeepSeekMath eq. 3 for grpo, Dr. GRPO, DAPO's token-level average), and each
mutation of one term of that formula is told apart on the same tensors (the test can fail)."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from trainer.tasks.grpo_loss import aggregate, batch_std, group_advantages, per_token_terms, units_of

G, L_MAX = 3, 5
REWARDS = [1.0, 0.0, 0.5, 2.0, 2.0, -1.0]  # two groups of three
LENGTHS = [5, 2, 4, 1, 3, 5]  # completion tokens per row
# log pi_theta - log pi_old per token: ratios inside the clip range, below 1 - eps and above 1 + eps_high
DELTAS = [[0.0, 0.3, -0.4, 0.05, 0.6], [-0.5, 0.25, 9, 9, 9], [0.1, -0.1, 0.35, -0.3, 9],
          [0.4, 9, 9, 9, 9], [-0.6, 0.0, 0.15, 9, 9], [0.2, -0.25, 0.3, 0.05, -0.05]]  # 9 = padding (masked)
OLD = [[-1.0, -2.0, -0.5, -3.0, -1.5]] * 6
REF_SHIFT = [[1.0, -0.8, 0.5, 0.0, 1.2]] * 6


def paper_loss(loss_type: str, eps: float, eps_high: float, beta: float, scale: str = "group", mutate: str = "") -> float:
    """The objective written out term by term (python floats, per completion i and token t)."""
    groups = [REWARDS[g * G:(g + 1) * G] for g in range(len(REWARDS) // G)]
    adv = []
    for r in groups:
        mean = sum(r) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))
        adv += [(x - mean) / (std + 1e-4) if scale == "group" and mutate != "no_std" else x - mean for x in r]
    total, tokens = 0.0, sum(LENGTHS)
    per_completion = []
    for i, n in enumerate(LENGTHS):
        s = 0.0
        for t in range(n):
            logp = OLD[i][t] + DELTAS[i][t]
            ratio = math.exp(logp - OLD[i][t])
            hi = eps if mutate == "symmetric_clip" else eps_high
            clipped = min(max(ratio, 1 - eps), 1 + hi)
            term = min(ratio * adv[i], clipped * adv[i]) if mutate != "no_clip" else ratio * adv[i]
            ref = logp + REF_SHIFT[i][t]
            kl = math.exp(ref - logp) - (ref - logp) - 1
            if mutate == "kl_sign":
                kl = math.exp(logp - ref) - (logp - ref) - 1
            s += -term + beta * kl
        per_completion.append(s)
    if loss_type == "grpo":
        norm = [1 if mutate == "no_length_norm" else n for n in LENGTHS]
        total = sum(s / n for s, n in zip(per_completion, norm)) / len(LENGTHS)
    elif loss_type == "dr_grpo":
        total = sum(per_completion) / (L_MAX * len(LENGTHS))
    else:
        total = sum(per_completion) / tokens
    return total


def ours(loss_type: str, eps: float, eps_high: float, beta: float, scale: str = "group") -> float:
    old = torch.tensor(OLD, dtype=torch.float64)
    logps = old + torch.tensor(DELTAS, dtype=torch.float64)
    mask = torch.tensor([[1.0] * n + [0.0] * (L_MAX - n) for n in LENGTHS], dtype=torch.float64)
    adv = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), G, scale).double()
    terms = per_token_terms(logps, old, adv, epsilon=eps, epsilon_high=eps_high, beta=beta,
                            ref_logps=logps + torch.tensor(REF_SHIFT, dtype=torch.float64))
    loss_sum = aggregate(terms["loss"], mask, loss_type, L_MAX)
    return float(loss_sum) / units_of(loss_type, len(LENGTHS), sum(LENGTHS))


CASES = [("grpo", 0.2, 0.2, 0.0, "group"), ("grpo", 0.2, 0.28, 0.04, "group"), ("dr_grpo", 0.2, 0.2, 0.0, "none"),
         ("dr_grpo", 0.1, 0.3, 0.1, "group"), ("dapo", 0.2, 0.28, 0.0, "group"), ("dapo", 0.2, 0.28, 0.05, "none")]


@pytest.mark.parametrize("loss_type,eps,eps_high,beta,scale", CASES)
def test_loss_equals_the_papers_formula(loss_type, eps, eps_high, beta, scale):
    want = paper_loss(loss_type, eps, eps_high, beta, scale)
    assert ours(loss_type, eps, eps_high, beta, scale) == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mutate,case", [("no_clip", CASES[1]), ("symmetric_clip", CASES[1]), ("kl_sign", CASES[1]), ("kl_sign", CASES[5]),
                                         ("no_std", CASES[0]), ("no_length_norm", CASES[0])])
def test_a_mutated_term_is_told_apart(mutate, case):
    """The hand-made tensors exercise every term: changing one of them moves the loss well beyond rounding."""
    assert abs(ours(*case) - paper_loss(*case, mutate=mutate)) > 1e-3


def test_clip_fraction_kl_and_equal_rewards():
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0]), 3)
    assert torch.equal(adv[:3], torch.zeros(3))  # no signal from a group that agrees, and no division by 0
    assert adv[3:].tolist() == pytest.approx([-1 / (1 + 1e-4), 0.0, 1 / (1 + 1e-4)])
    logps = torch.log(torch.tensor([[0.5, 0.9, 0.1]]))
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))  # ratios 1, 1.8, 0.2
    t = per_token_terms(logps, old, torch.tensor([1.0]), epsilon=0.2)
    assert t["clipped"].tolist() == [[0.0, 1.0, 0.0]]  # A > 0: only the ratio above 1 + eps is clipped
    t = per_token_terms(logps, old, torch.tensor([-1.0]), epsilon=0.2, beta=0.1, ref_logps=logps)
    assert t["clipped"].tolist() == [[0.0, 0.0, 1.0]] and torch.equal(t["kl"], torch.zeros(1, 3))
    with pytest.raises(ValueError, match="reference"):
        per_token_terms(logps, old, torch.tensor([1.0]), epsilon=0.2, beta=0.1)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_scale_rewards_equals_its_formula(scale):
    """A_i = r_i - mean(group), divided by the group's std (group), the std of every reward of the step (batch, TRL's
    and Lite PPO's), or nothing (none, Dr. GRPO); stds unbiased, + 1e-4; written out in python floats."""
    groups = [REWARDS[g * G:(g + 1) * G] for g in range(len(REWARDS) // G)]
    mean_all = sum(REWARDS) / len(REWARDS)
    std_all = math.sqrt(sum((x - mean_all) ** 2 for x in REWARDS) / (len(REWARDS) - 1))
    want = []
    for r in groups:
        mean = sum(r) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))
        scale_by = {"group": std + 1e-4, "batch": std_all + 1e-4, "none": 1.0}[scale]
        want += [(x - mean) / scale_by for x in r]
    dev = sum((x - mean_all) ** 2 for x in REWARDS)
    got = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), G, scale,
                           batch_std(len(REWARDS), dev) if scale == "batch" else None)
    assert got.tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert batch_std(len(REWARDS), dev) == pytest.approx(std_all, rel=1e-12)


def test_batch_scale_needs_the_steps_std_and_unknown_scales_are_refused():
    with pytest.raises(ValueError, match="batch_std"):
        group_advantages(torch.tensor(REWARDS), G, "batch")
    with pytest.raises(ValueError, match="group | batch | none"):
        group_advantages(torch.tensor(REWARDS), G, "global")
    assert batch_std(1, 0.0) == 0.0


def test_the_tasks_batch_scale_spans_every_micro_batch_of_the_step():
    """GRPOTask: --scale_rewards=batch divides by the std of the whole step's rewards, whichever micro-batches
    they fell in: two micro-batches of one group each give what one micro-batch of both groups gives."""
    from types import SimpleNamespace

    from trainer.tasks.grpo import GRPOTask
    cfg = SimpleNamespace(scale_rewards="batch", num_generations=G, reward_funcs="exact_match", reward_fn="",
                          reward_weights="", loss_type="dapo", beta=0.0, max_prompt_length=4, max_completion_length=4)
    task = GRPOTask(cfg)
    loop = SimpleNamespace(info=SimpleNamespace(world_size=1))
    r = torch.tensor(REWARDS, dtype=torch.float64)
    split = [{"reward": r[:G]}, {"reward": r[G:]}]
    whole = [{"reward": r}]
    task._advantages(split, loop, torch.device("cpu"))
    task._advantages(whole, loop, torch.device("cpu"))
    want = group_advantages(r, G, "batch", statistics.stdev(REWARDS)).float()
    assert torch.equal(torch.cat([b["advantages"] for b in split]), whole[0]["advantages"])
    assert whole[0]["advantages"].tolist() == pytest.approx(want.tolist(), rel=1e-6)
