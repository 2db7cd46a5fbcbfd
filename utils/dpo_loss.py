"""Direct Preference Optimization losses (sigmoid / IPO / hinge) on sequence log-probabilities.

Owns: turning policy and reference log-probs of chosen and rejected replies into a loss and
the rewards that are logged. Must never touch models or data: it is pure tensor math.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, *, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the implicit rewards beta * (log pi - log pi_ref).

    Inputs are summed log-probabilities of the reply tokens, shape [P]. Returns
    (losses [P], chosen_rewards [P], rejected_rewards [P]); rewards are detached.
    sigmoid: -(1-eps) log sigma(beta*h) - eps log sigma(-beta*h)  (eps = label smoothing, cDPO)
    ipo:     (h - 1/(2 beta))^2                                   (Azar et al. 2023)
    hinge:   relu(1 - beta*h)                                     (SLiC)
    where h = (log pi(c) - log pi(r)) - (log ref(c) - log ref(r)).
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown dpo loss {loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = torch.relu(1.0 - beta * h)
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards
