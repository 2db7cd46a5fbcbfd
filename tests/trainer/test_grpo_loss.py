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


def _advantages(by_std: bool = True) -> list[float]:
    """Each reward minus its group's mean, divided by the group's (unbiased) std + 1e-4 when `by_std`."""
    adv = []
    for r in [REWARDS[g * G:(g + 1) * G] for g in range(len(REWARDS) // G)]:
        mean = sum(r) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))
        adv += [(x - mean) / (std + 1e-4) if by_std else x - mean for x in r]
    return adv


def paper_loss(loss_type: str, eps: float, eps_high: float, beta: float, scale: str = "group", mutate: str = "") -> float:
    """The objective written out term by term (python floats, per completion i and token t)."""
    adv = _advantages(by_std=scale == "group" and mutate != "no_std")
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


def test_bnpo_is_the_mean_of_each_micro_batchs_token_average():
    """bnpo (TRL's): the step split in two micro-batches (rows 0-2: 11 tokens, rows 3-5: 9) is the mean of each
    micro-batch's token average, one unit each; over one micro-batch it is dapo; split, it is not dapo (the
    micro-batches' tokens weigh 1/22 and 1/18, not 1/20)."""
    old = torch.tensor(OLD, dtype=torch.float64)
    logps = old + torch.tensor(DELTAS, dtype=torch.float64)
    mask = torch.tensor([[1.0] * n + [0.0] * (L_MAX - n) for n in LENGTHS], dtype=torch.float64)
    adv = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), G).double()
    per_token = per_token_terms(logps, old, adv, epsilon=0.2, epsilon_high=0.28, beta=0.0)["loss"]
    parts = [slice(0, 3), slice(3, 6)]
    got = sum(float(aggregate(per_token[p], mask[p], "bnpo", L_MAX)) for p in parts) / sum(
        units_of("bnpo", 3, int(mask[p].sum())) for p in parts)
    want = []
    for p in parts:
        rows = range(6)[p]
        tokens = [float(per_token[i, t]) for i in rows for t in range(LENGTHS[i])]
        want.append(sum(tokens) / len(tokens))
    assert got == pytest.approx(sum(want) / 2, rel=1e-12)
    dapo = ours("dapo", 0.2, 0.28, 0.0)
    assert float(aggregate(per_token, mask, "bnpo", L_MAX)) / units_of("bnpo", 6, 20) == pytest.approx(dapo, rel=1e-12)
    assert abs(got - dapo) > 1e-4
    from types import SimpleNamespace

    from trainer.tasks.grpo import GRPOTask  # the trainer divides by the step's units: one per micro-batch
    task = GRPOTask(SimpleNamespace(num_generations=G, reward_funcs="exact_match", reward_fn="", reward_weights="",
                                    loss_type="bnpo", beta=0.0, max_prompt_length=4, max_completion_length=4))
    assert task.units == "micro-batches"
    assert task.count_units({"input_ids": torch.zeros(3, 9), "completion_mask": mask[:3]}) == 1


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


# --- CISPO, two-sided clipping (delta), sequence-level ratios (GSPO) ----------------------------------------------

SAPO_TAUS = (0.8, 1.6)  # (positive, negative advantage): not TRL's defaults, so that a swap shows


def variant_loss(logp: list, loss_type: str, eps: float, eps_high: float, delta: float = 0.0, level: str = "token",
                 beta: float = 0.0) -> float:
    """The variants' objectives written out per completion and token (python floats), token-level average (dapo's
    and cispo's) unless loss_type is grpo. `logp` [row][t]: pi_theta's log-probabilities."""
    adv, tokens = _advantages(), sum(LENGTHS)
    per_completion = []
    for i, n in enumerate(LENGTHS):
        seq = math.exp(sum(logp[i][t] - OLD[i][t] for t in range(n)) / n)  # GSPO's s_i
        s = 0.0
        for t in range(n):
            r = seq if level == "sequence" else math.exp(logp[i][t] - OLD[i][t])
            if loss_type == "cispo":
                term = -min(r, 1 + eps_high) * adv[i] * logp[i][t]  # the value; its gradient is the weight's alone
            elif loss_type == "sapo":
                tau = SAPO_TAUS[0] if adv[i] > 0 else SAPO_TAUS[1]
                term = -(4 / tau) / (1 + math.exp(-tau * (r - 1))) * adv[i]
            else:
                unclipped = (min(r, delta) if delta > 0 else r) * adv[i]
                term = -min(unclipped, min(max(r, 1 - eps), 1 + eps_high) * adv[i])
            ref = OLD[i][t] + DELTAS[i][t] + REF_SHIFT[i][t]  # the frozen reference's: fixed when logp moves
            s += term + beta * (math.exp(ref - logp[i][t]) - (ref - logp[i][t]) - 1)
        per_completion.append(s)
    if loss_type in ("grpo", "sapo"):
        return sum(s / n for s, n in zip(per_completion, LENGTHS)) / len(LENGTHS)
    return sum(per_completion) / tokens


def ours_variant(logps: torch.Tensor, loss_type: str, eps: float, eps_high: float, delta: float = 0.0,
                 level: str = "token", beta: float = 0.0) -> torch.Tensor:
    old = torch.tensor(OLD, dtype=torch.float64)
    mask = torch.tensor([[1.0] * n + [0.0] * (L_MAX - n) for n in LENGTHS], dtype=torch.float64)
    adv = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), G, "group").double()
    terms = per_token_terms(logps, old, adv, epsilon=eps, epsilon_high=eps_high, beta=beta,
                            ref_logps=(logps + torch.tensor(REF_SHIFT, dtype=torch.float64)).detach() if beta else None,
                            loss_type=loss_type, delta=delta, level=level, mask=mask, sapo_temperatures=SAPO_TAUS)
    return aggregate(terms["loss"], mask, loss_type, L_MAX) / units_of(loss_type, len(LENGTHS), sum(LENGTHS))


VARIANTS = [("cispo", 0.2, 0.28, 0.0, "token", 0.0), ("cispo", 0.2, 0.1, 0.0, "sequence", 0.04),
            ("dapo", 0.2, 0.28, 1.3, "token", 0.0), ("grpo", 0.2, 0.28, 1.3, "token", 0.05),
            ("dapo", 0.05, 0.06, 0.0, "sequence", 0.0), ("grpo", 0.1, 0.2, 1.25, "sequence", 0.0),
            ("sapo", 0.2, 0.28, 0.0, "token", 0.0), ("sapo", 0.2, 0.28, 0.0, "sequence", 0.04)]


def _logps() -> torch.Tensor:
    return (torch.tensor(OLD, dtype=torch.float64) + torch.tensor(DELTAS, dtype=torch.float64)).requires_grad_()


@pytest.mark.parametrize("loss_type,eps,eps_high,delta,level,beta", VARIANTS)
def test_variants_equal_their_formulas_value_and_gradient(loss_type, eps, eps_high, delta, level, beta):
    """The loss equals its formula; its gradient equals the formula's (central differences of the written-out
    loss; CISPO: the detached capped weight times -A over the step's tokens, the KL's derivative beside it)."""
    logps = _logps()
    loss = ours_variant(logps, loss_type, eps, eps_high, delta, level, beta)
    base = logps.detach().tolist()
    assert float(loss.detach()) == pytest.approx(variant_loss(base, loss_type, eps, eps_high, delta, level, beta),
                                        rel=1e-12, abs=1e-12)
    loss.backward()
    adv, tokens, h = _advantages(), sum(LENGTHS), 1e-6
    for i, n in enumerate(LENGTHS):
        for t in range(L_MAX):
            if t >= n:
                assert logps.grad[i, t] == 0  # padding
                continue
            if loss_type == "cispo":
                r = math.exp(base[i][t] - OLD[i][t]) if level == "token" else \
                    math.exp(sum(base[i][k] - OLD[i][k] for k in range(n)) / n)
                # + the KL's: e^d - d - 1 with d = ref - logp, d/dlogp = 1 - e^d (d = REF_SHIFT here)
                want = (-min(r, 1 + eps_high) * adv[i] + beta * (1 - math.exp(REF_SHIFT[i][t]))) / tokens
            else:
                up, down = [row[:] for row in base], [row[:] for row in base]
                up[i][t] += h
                down[i][t] -= h
                want = (variant_loss(up, loss_type, eps, eps_high, delta, level, beta)
                        - variant_loss(down, loss_type, eps, eps_high, delta, level, beta)) / (2 * h)
            assert float(logps.grad[i, t]) == pytest.approx(want, rel=1e-6, abs=1e-9), (i, t)


@pytest.mark.parametrize("variant,mutated", [(VARIANTS[2], ("dapo", 0.2, 0.28, 0.0, "token", 0.0)),
                                             (VARIANTS[4], ("dapo", 0.05, 0.06, 0.0, "token", 0.0)),
                                             (VARIANTS[0], ("cispo", 0.2, 0.5, 0.0, "token", 0.0)),
                                             (VARIANTS[6], ("grpo", 0.2, 0.28, 0.0, "token", 0.0))])
def test_each_option_changes_the_loss(variant, mutated):
    """delta, the sequence level, CISPO's cap and SAPO's gate each move the loss on these tensors (the tests above
    can fail)."""
    a, b = (float(ours_variant(_logps(), *v).detach()) for v in (variant, mutated))
    assert abs(a - b) > 1e-3


def test_sequence_level_clip_counts_whole_completions_and_options_are_checked():
    logps = torch.log(torch.tensor([[0.5, 0.9, 0.1], [0.5, 0.5, 0.5]]))
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # row 0's mean log-ratio: log(1.8) / 2
    t = per_token_terms(logps, old, torch.tensor([1.0, 1.0]), epsilon=0.2, level="sequence", mask=mask)
    assert t["ratio"][0].tolist() == pytest.approx([1.8 ** 0.5] * 3) and t["ratio"][1].tolist() == [1.0] * 3
    assert t["clipped"].tolist() == [[1.0] * 3, [0.0] * 3]  # 1.34 > 1.2 with A > 0: the whole completion
    with pytest.raises(ValueError, match="completion mask"):
        per_token_terms(logps, old, torch.tensor([1.0, 1.0]), epsilon=0.2, level="sequence")
    with pytest.raises(ValueError, match="token | sequence"):
        per_token_terms(logps, old, torch.tensor([1.0, 1.0]), epsilon=0.2, level="turn")


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.9, 1.0])
def test_high_entropy_mask_keeps_the_top_quantile_as_torch_quantile_picks_it(quantile):
    """The mask against torch.quantile of the completion tokens' entropies picked out on the host (padding's
    entropies are large here: they must not count), on rows of several lengths."""
    from trainer.tasks.grpo_loss import high_entropy_mask
    g = torch.Generator().manual_seed(3)
    entropy = torch.rand(4, 9, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0] * n + [0.0] * (9 - n) for n in (9, 5, 2, 7)], dtype=torch.float64)
    entropy = torch.where(mask > 0, entropy, entropy + 10.0)
    got = high_entropy_mask(entropy, mask, quantile)
    threshold = torch.quantile(entropy[mask > 0].float(), 1.0 - quantile)
    want = ((mask > 0) & (entropy.float() >= threshold)).double()
    assert torch.equal(got, want)
    assert int(got.sum()) == int((entropy[mask > 0].float() >= threshold).sum()) > 0
    assert abs(float(got.sum()) - quantile * float(mask.sum())) <= 1.0  # about the top-q share
