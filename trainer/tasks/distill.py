"""Knowledge distillation on SFT data (Hinton et al. 2015; the supervised KD of TRL's GKDTrainer with lmbda = 0): a
frozen teacher (--ref_model) and the student both score every target token of a conversation's assistant replies,
and the student learns the teacher's whole next-token distribution there, not only the reference token.

Per target token t (labels != -100), with p = softmax(teacher logits / T) and q = softmax(student logits / T):
  forward_kl (default):  T^2 KL(p || q) = T^2 sum_v p_v (log p_v - log q_v)      (the student covers the teacher)
  reverse_kl:            T^2 KL(q || p)                                             (the student seeks its modes)
  jsd:                   T^2 (beta KL(p || m) + (1 - beta) KL(q || m)), m = beta p + (1 - beta) q   (GKD's
                         generalized Jensen-Shannon divergence, Agarwal et al. 2024, as TRL's GKDTrainer computes
                         it; --distill_beta, 0.5 by default as TRL's)
  loss = --distill_alpha x CE(student, the reference token) + (1 - alpha) x that KL
summed over the step's target tokens and averaged as SFT's loss is. Only the target positions' logits are computed
(the model's boolean logits_to_keep: [N, V] for N target tokens, both models), so memory grows with N x V: a smaller
--batch_size (with --gradient_accumulation_steps) bounds it. The teacher must share the student's tokenizer (the same
vocabulary size, checked at the start).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from trainer.config import DISTILL_LOSSES
from trainer.tasks.base import lm_inputs
from trainer.tasks.sft import SFTTask
from utils.constants import IGNORE_INDEX



def distill_loss(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                 alpha: float = 0.0, loss_type: str = "forward_kl",
                 beta: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token losses [N] of the student's and the teacher's logits [N, V] at N target tokens `targets` [N] (fp32
    inside), and the two terms: (alpha CE + (1 - alpha) T^2 D, D [N] detached, CE [N] detached), D the divergence
    `loss_type` names (jsd: `beta`'s generalized Jensen-Shannon divergence)."""
    if loss_type not in DISTILL_LOSSES:
        raise ValueError(f"unknown distillation loss {loss_type!r}; expected one of {DISTILL_LOSSES}")
    dtype = torch.promote_types(student.dtype, torch.float32)  # (at least fp32; the tests' fp64 stays fp64)
    student, teacher = student.to(dtype), teacher.to(dtype)
    s = F.log_softmax(student / temperature, dim=-1)
    t = F.log_softmax(teacher / temperature, dim=-1)
    if loss_type == "forward_kl":
        kl = (t.exp() * (t - s)).sum(-1)
    elif loss_type == "reverse_kl":
        kl = (s.exp() * (s - t)).sum(-1)
    else:
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd needs 0 < beta < 1, got {beta}")
        m = torch.logaddexp(t + math.log(beta), s + math.log(1.0 - beta))  # log of the mixture
        kl = beta * (t.exp() * (t - m)).sum(-1) + (1.0 - beta) * (s.exp() * (s - m)).sum(-1)
    ce = F.cross_entropy(student, targets, reduction="none")
    losses = alpha * ce + (1 - alpha) * temperature ** 2 * kl
    return losses, kl.detach(), ce.detach()


class DistillTask(SFTTask):
    """SFT's data and units (target tokens); the loss of `distill_loss` against the frozen teacher (the run's
    reference model, --ref_model)."""
    name = "distill"
    stat_keys = ("kl", "ce")
    val_stat_keys = ("kl", "ce")
    needs_reference = True

    def micro_batch_loss(self, model, ref_model, batch, device):
        cfg = self.cfg
        x, y, kw = lm_inputs(batch, device)
        keep = y != IGNORE_INDEX
        student = model(x, logits_to_keep=keep, **kw)  # [N, V]: the target positions in row-major order
        with torch.no_grad():
            teacher = ref_model(x, logits_to_keep=keep, **kw)
        losses, kl, ce = distill_loss(student, teacher, y[keep], temperature=cfg.distill_temperature,
                                      alpha=cfg.distill_alpha, loss_type=cfg.distill_loss, beta=cfg.distill_beta)
        return losses.sum(), {"kl": kl.sum(), "ce": ce.sum()}

    def reference_problem(self, student_cfg, teacher_cfg) -> Optional[str]:
        if teacher_cfg.vocab_size != student_cfg.vocab_size or teacher_cfg.num_labels:
            return (f"--ref_model (the teacher) has {teacher_cfg.num_labels or teacher_cfg.vocab_size} outputs, the "
                    f"student {student_cfg.vocab_size}: distillation compares their distributions over one "
                    "tokenizer's vocabulary")
        return None

