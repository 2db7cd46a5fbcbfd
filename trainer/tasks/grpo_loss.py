"""GRPO's loss as pure tensor math: group-normalised advantages, the clipped policy-gradient term per token, the
optional KL penalty to a frozen reference, and the ways of averaging tokens into the loss.

Owns: `group_advantages`, `batch_std`, `per_token_terms`, `high_entropy_mask`, `aggregate` (the loss summed over the
task's units, which the trainer divides by the step's units over all micro-batches and ranks), `units_of`.
Must never: read a device value to the host, or know where the log-probabilities came from.

The objective (DeepSeekMath, Shao et al. 2024, eq. 3), per completion o_i of a group of G for one prompt:
    ratio_t = pi_theta(o_t) / pi_old(o_t),  A_i = (r_i - mean(r)) / (std(r) + eps)
    l_t = -min(ratio_t A_i, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) A_i) + beta KL_t
    KL_t = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1          (the k3 estimator, always >= 0)
Averaged by --loss_type:
    grpo:    (1/G) sum_i (1/|o_i|) sum_t l_t              (the paper: each completion weighs the same)
    dr_grpo: (1/G) sum_i (1/L_max) sum_t l_t              (Dr. GRPO, Liu et al. 2025: no length bias; L_max =
                                                          --max_completion_length, a constant)
    dapo:    (1/sum_i |o_i|) sum_i sum_t l_t              (DAPO, Yu et al. 2025: token-level, every token of the
                                                          step weighs the same, over all micro-batches and ranks)
    bnpo:    dapo's average within each micro-batch, then the mean over the step's micro-batches (TRL's "bnpo":
             normalised by the tokens of the local batch, so it depends on how the step is split)
    cispo:   dapo's average of CISPO's token term (MiniMax-M1, Chen et al. 2025): the importance weight capped and
             detached multiplies the log-probability, l_t = -sg(min(ratio_t, 1 + epsilon_high)) A_i log pi_theta(o_t)
             + beta KL_t: no token's gradient is dropped, the large weights are bounded instead
    sapo:    grpo's average (each completion weighs the same) of SAPO's soft gate in place of the clip (Gao et al.
             2025, "Soft Adaptive Policy Optimization"; TRL's loss_type="sapo"): l_t = -(4 / tau) sigmoid(tau
             (ratio_t - 1)) A_i + beta KL_t, tau = sapo_temperature_pos where A_i > 0, else _neg: the gradient is
             the policy gradient's at ratio 1 and fades smoothly as the ratio leaves 1 (no hard cut)
--top_entropy_quantile=q < 1 (Wang et al. 2025, "Beyond the 80/20 Rule"; TRL's name): the policy term trains on
    the micro-batch's top-q share of completion tokens by entropy only (`high_entropy_mask`), the KL on every token;
    the averages keep their denominators
Two options of the clipped objective (TRL's names):
    delta > 0 (two-sided clipping, INTELLECT-2): the unclipped term's ratio is capped at delta too, bounding the
              loss of a negative-advantage token whose ratio ran away (delta > 1 + epsilon_high)
    importance_sampling_level = "sequence" (GSPO, Zheng et al. 2025): ratio_t is one number per completion, the
              exponential of the mean of its tokens' log-ratios, clipped as a whole (GSPO's epsilons are ~3e-4)
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from trainer.tasks.grpo_flags import IS_LEVELS, LOSS_TYPES, SCALE_REWARDS  # the choices, defined torch-free

TOKEN_AVERAGED = ("dapo", "cispo")  # the loss types whose units are the step's completion tokens
PER_COMPLETION_MEAN = ("grpo", "sapo")  # the loss types averaging each completion's tokens, then the completions
MICRO_BATCH_MEAN = ("bnpo",)  # the loss types averaging each micro-batch's tokens, then the micro-batches
ADV_EPS = 1e-4  # TRL's: a group whose rewards all agree has std 0 and advantage 0, never a division by zero


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group",
                     batch_std: Optional[float] = None) -> torch.Tensor:
    """rewards [N] (N = groups x group_size, each group's completions contiguous) -> advantages [N]: the reward
    minus its group's mean, divided by
      group: the group's (unbiased) std + ADV_EPS (GRPO, DeepSeekMath),
      batch: `batch_std` + ADV_EPS, the (unbiased) std of every reward of the step over all micro-batches and
             ranks (TRL's scale_rewards="batch", after "Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
             Liu et al. 2025: the group mean, a robust scale),
      none:  nothing (Dr. GRPO, Liu et al. 2025: the std division biases towards too easy and too hard prompts)."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale!r}: expected {' | '.join(SCALE_REWARDS)}")
    r = rewards.to(torch.promote_types(rewards.dtype, torch.float32)).reshape(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])
        adv = adv / (std + ADV_EPS)
    elif scale == "batch":
        if batch_std is None:
            raise ValueError("scale_rewards='batch' needs the std of the step's rewards (batch_std)")
        adv = adv / (float(batch_std) + ADV_EPS)
    return adv.reshape(-1)


def batch_std(count: float, sum_sq_dev: float) -> float:
    """The unbiased std of a step's rewards from their count and the sum of their squared deviations from their
    mean, both over every micro-batch and rank (0 for fewer than 2 rewards)."""
    return math.sqrt(sum_sq_dev / (count - 1)) if count > 1 else 0.0


def per_token_terms(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, *, epsilon: float,
                    epsilon_high: Optional[float] = None, beta: float = 0.0,
                    ref_logps: Optional[torch.Tensor] = None,
                    is_weights: Optional[torch.Tensor] = None, loss_type: str = "dapo", delta: float = 0.0,
                    level: str = "token", mask: Optional[torch.Tensor] = None,
                    sapo_temperatures: tuple[float, float] = (1.0, 1.05)) -> dict[str, torch.Tensor]:
    """Per-token terms, all [B, T] (padding included; `aggregate` masks it):
    loss (the l_t above, times `is_weights` when given: the truncated importance-sampling correction),
    kl (0 without a reference), clipped (1.0 where the clip took effect: ratio below 1 - epsilon with A < 0,
    above 1 + epsilon_high with A > 0, above delta with A < 0; cispo: above its cap; sapo: never, its gate is
    soft), ratio. sapo_temperatures: SAPO's (tau for A > 0, tau for A <= 0). advantages: [B] (one per row) or
    [B, T] (one per token: on-policy distillation's, trainer/tasks/grpo.py).
    level "sequence" needs `mask` (1 on completion tokens: whose log-ratios are averaged)."""
    if level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level={level!r}: expected {' | '.join(IS_LEVELS)}")
    eps_high = epsilon if epsilon_high is None else epsilon_high
    log_ratio = logps - old_logps
    if level == "sequence":
        if mask is None:
            raise ValueError("importance_sampling_level='sequence' needs the completion mask")
        on = mask > 0
        log_ratio = torch.where(on, log_ratio, torch.zeros_like(log_ratio)).sum(-1, keepdim=True) / \
            on.sum(-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
    ratio = torch.exp(log_ratio)  # [B, T], or [B, 1] per completion (sequence)
    adv = (advantages[:, None] if advantages.dim() == 1 else advantages).to(logps.dtype)  # per row, or per token
    if loss_type == "cispo":
        cap = 1.0 + eps_high
        loss = -torch.clamp(ratio, max=cap).detach() * adv * logps
        was_clipped = (ratio > cap).expand_as(logps)
    elif loss_type == "sapo":
        pos, neg = sapo_temperatures
        tau = torch.where(adv > 0, torch.full_like(adv, pos), torch.full_like(adv, neg))
        loss = -(torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv).expand_as(logps)
        was_clipped = torch.zeros_like(logps, dtype=torch.bool)
    else:
        unclipped = (torch.clamp(ratio, max=delta) if delta > 0 else ratio) * adv
        clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + eps_high) * adv
        loss = -torch.min(unclipped, clipped).expand_as(logps)
        was_clipped = ((ratio < 1.0 - epsilon) & (adv < 0)) | ((ratio > 1.0 + eps_high) & (adv > 0))
        if delta > 0:
            was_clipped = was_clipped | ((ratio > delta) & (adv < 0))
        was_clipped = was_clipped.expand_as(logps)
    if is_weights is not None:
        loss = loss * is_weights
    kl = torch.zeros_like(logps)
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs the reference model's log-probabilities")
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1.0
        loss = loss + beta * kl
    return {"loss": loss, "kl": kl, "clipped": was_clipped.to(logps.dtype), "ratio": ratio.expand_as(logps)}


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """[B, T] 1.0 on the completion tokens whose entropy is at least the (1 - quantile) quantile of these rows'
    completion-token entropies (torch.quantile's linear interpolation), else 0: the top `quantile` share of the
    most uncertain tokens ("Beyond the 80/20 Rule", Wang et al. 2025; TRL's top_entropy_quantile). No host read
    (the quantile's position is a device value)."""
    on = mask > 0
    values = torch.where(on, entropy.detach().float(), torch.full_like(entropy, float("inf"), dtype=torch.float32))
    ranked = values.reshape(-1).sort().values  # the completion tokens' entropies first, ascending
    pos = (1.0 - quantile) * (on.sum() - 1).clamp(min=0).float()
    lo, hi = pos.floor().long(), pos.ceil().long()
    threshold = ranked[lo] + (ranked[hi] - ranked[lo]) * (pos - lo.float())
    return (on & (entropy.detach().float() >= threshold)).to(entropy.dtype)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_length: int) -> torch.Tensor:
    """The loss of these rows summed over the task's units (`units_of`): per completion the mean over its
    tokens (grpo, sapo), its sum over L_max (dr_grpo); the sum over every token (dapo, cispo); the mean over these
    rows' tokens (bnpo: one unit, the micro-batch). mask [B, T]: 1 on completion tokens."""
    m = mask.to(per_token.dtype)
    summed = torch.where(m > 0, per_token, torch.zeros_like(per_token)).sum(dim=-1)  # padding never leaks a nan
    if loss_type in PER_COMPLETION_MEAN:
        return (summed / m.sum(dim=-1).clamp(min=1.0)).sum()
    if loss_type == "dr_grpo":
        return summed.sum() / float(max_completion_length)
    if loss_type in TOKEN_AVERAGED:
        return summed.sum()
    if loss_type in MICRO_BATCH_MEAN:
        return summed.sum() / m.sum().clamp(min=1.0)
    raise ValueError(f"loss_type={loss_type!r}: expected {' | '.join(LOSS_TYPES)}")


def units_of(loss_type: str, completions: int, completion_tokens: int) -> int:
    """What `aggregate`'s sum is divided by over the whole step: completions (grpo, dr_grpo, sapo), completion
    tokens (dapo, cispo) or micro-batches (bnpo: each counts 1)."""
    if loss_type in MICRO_BATCH_MEAN:
        return 1
    return int(completion_tokens) if loss_type in TOKEN_AVERAGED else int(completions)
