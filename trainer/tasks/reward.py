"""Reward modelling (TRL's RewardTrainer; Ouyang et al. 2022): a model whose head scores a whole sequence
(model/score_head.py: ModelConfig.num_labels = 1, read at the sequence's last token), trained on preference pairs
(DPO's data: prompt, chosen, rejected) so that the chosen reply scores above the rejected one.

Per pair, with r_c and r_r the scores of prompt + chosen and prompt + rejected (each ending with the reply's final
token, <|im_end|>) and m the pair's "margin" (its record's, 0 where it has none: Llama 2's margin, TRL's column):
  loss = -log sigma(r_c - r_r - m)  +  c (r_c + r_r)^2      (Bradley-Terry; c = --reward_center_coef)
averaged over the step's pairs, as TRL averages over its batch. A run starts from a language model (its LM head is
replaced by a new score head: trainer/start.py) or from a reward model (ours, or a Hugging Face
*ForSequenceClassification); the export is a *ForSequenceClassification that transformers and TRL load.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from evals.preferences import pair_scores
from trainer.tasks.base import Task
from trainer.tasks.dpo import preference_data


def reward_loss(chosen: torch.Tensor, rejected: torch.Tensor, center_coef: float = 0.0,
                margin: "torch.Tensor | None" = None) -> torch.Tensor:
    """Per-pair losses [P] of the chosen and rejected replies' scores [P]: -log sigma(r_c - r_r - margin) (the
    pairs' margins [P], 0 where None), plus center_coef x (r_c + r_r)^2 when it is not 0."""
    diff = chosen - rejected
    losses = -F.logsigmoid(diff if margin is None else diff - margin.to(diff))
    if center_coef:
        losses = losses + center_coef * (chosen + rejected) ** 2
    return losses


class RewardTask(Task):
    name = "reward"
    units = "preference pairs"
    stat_keys = ("chosen_reward", "rejected_reward", "reward_acc", "reward_margin")
    val_stat_keys = ("reward_acc", "reward_margin")
    chat = True

    def datasets(self, tok_meta, val_ratio, fixed_shape, log):
        return preference_data(self.cfg, tok_meta, val_ratio, fixed_shape, log, margins=True)

    def micro_batch_loss(self, model, ref_model, batch, device):
        chosen, rejected = pair_scores(model, batch, device, self.cfg.max_seq_len)
        margin = batch.get("margin")
        losses = reward_loss(chosen, rejected, self.cfg.reward_center_coef,
                             None if margin is None else margin.to(device, non_blocking=True))
        c, r = chosen.detach(), rejected.detach()
        stats = {"chosen_reward": c.sum(), "rejected_reward": r.sum(), "reward_acc": (c > r).float().sum(),
                 "reward_margin": (c - r).sum()}
        return losses.sum(), stats

    def count_units(self, batch):
        return int(batch["chosen_input_ids"].shape[0])

    def tokens_seen(self, units, tokens):
        """A pair is the unit: the tokens read (chosen and rejected, padding excluded) are what it saw."""
        return int(tokens)
