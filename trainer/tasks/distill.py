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
summed over the step's target tokens and averaged as SFT's loss is (model/distill_head.py has the formulas). The
teacher's logits are computed at the target positions only (its boolean logits_to_keep: [N, V] for N target tokens,
in its compute dtype); the student's in its LM head, --loss_chunk_size tokens at a time, never whole (their softmax and
gradient neither). The teacher must share the student's tokenizer, checked at the start (reference_problem: a row
for each of the tokenizer's ids; vocabularies padded to other sizes are compared over their common rows).
"""
from __future__ import annotations

from typing import Optional

import torch

from model.distill_head import distill_head
from trainer.tasks.base import lm_inputs
from trainer.tasks.sft import SFTTask
from utils.constants import IGNORE_INDEX


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
        with torch.no_grad():  # [N, V]: the target positions in row-major order
            teacher = ref_model(x, logits_to_keep=keep, **kw)
        head = distill_head(keep, teacher, y[keep], temperature=cfg.distill_temperature, alpha=cfg.distill_alpha,
                            loss_type=cfg.distill_loss, beta=cfg.distill_beta)
        loss, kl, ce = model(x, head=head, **kw)  # the student's logits chunk by chunk in its head
        return loss, {"kl": kl, "ce": ce}

    def reference_problem(self, student_cfg, teacher_cfg, vocab: int = 0) -> Optional[str]:
        """A teacher of the student's tokenizer: its vocabulary may differ from the student's by padding rows beyond
        the tokenizer's ids (Qwen2.5 7B's 152,064 against 0.5B's 151,936), then both distributions are compared over
        the first min(V_student, V_teacher) entries (model/distill_head.py)."""
        if teacher_cfg.num_labels or teacher_cfg.vocab_size < (vocab or student_cfg.vocab_size):
            return (f"--ref_model (the teacher) has {teacher_cfg.num_labels or teacher_cfg.vocab_size} outputs, the "
                    f"student {student_cfg.vocab_size}" + (f" and the tokenizer {vocab} ids" if vocab else "") +
                    ": distillation compares their distributions over one tokenizer's vocabulary")
        return None

