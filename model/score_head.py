"""A reward model: the Transformer whose head gives `num_labels` scores per position instead of the vocabulary's
logits (ModelConfig.num_labels; Hugging Face's *ForSequenceClassification, whose head is named `score`), and a
sequence's score read at its last real token, as transformers reads it.

Owns: turning a language model into a reward model (`add_score_head`: the blocks kept, the LM head replaced by a new
score head), the whole sequences of shifted training rows (`whole_rows`), and the scores at each row's last token
(`last_token_scores`).
Must never: read a tensor's value on the host (every index is computed on the device), or assume left padding.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from utils.constants import IGNORE_INDEX


def add_score_head(model: nn.Module, num_labels: int = 1) -> nn.Module:
    """Replace `model`'s LM head by a new score head of `num_labels` outputs, in place (its config too:
    num_labels set, tie_embeddings off): N(0, initializer_range) weights as transformers initialises the `score` of a
    *ForSequenceClassification built on a language model's checkpoint, drawn from the global generator (seeded
    alike on every rank). The blocks, the embedding and the final norm are the language model's."""
    cfg = model.cfg
    if cfg.num_labels:
        raise ValueError(f"the model already has a score head of {cfg.num_labels} outputs")
    if cfg.mtp_num_layers:
        raise ValueError("a model with multi-token prediction depths cannot become a reward model (no LM head)")
    old = model.lm_head.weight
    head = nn.Linear(cfg.dim, num_labels, bias=False, device=old.device, dtype=old.dtype)
    nn.init.normal_(head.weight, mean=0.0, std=cfg.initializer_range)
    model.lm_head = head
    cfg.num_labels, cfg.tie_embeddings = num_labels, False
    # the LM head's cap and divisor (Gemma 2's, Granite's): a score head has neither, as transformers' classifiers
    cfg.final_softcap = cfg.logits_scaling = None
    return model


def whole_rows(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor,
               max_len: Optional[int] = None, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequences of right-padded shifted rows (input_ids[t] and labels[t] = the token after it): each row's
    last label appended after its last input token, so the row ends with the reply's final token (<|im_end|>), where
    the score is read. A row whose last label is ignored (-100), or that holds `max_len` tokens already (its reply
    cut there), is kept as it is (its new position holds `pad_id`, masked). Returns (ids, attention_mask), each
    [B, min(T + 1, max_len)]."""
    B, T = input_ids.shape
    n = attention_mask.sum(dim=1, keepdim=True)  # [B, 1] real input tokens
    last = labels.gather(1, (n - 1).clamp(min=0))
    grow = last != IGNORE_INDEX
    if max_len is not None:
        grow = grow & (n < max_len)
    pad_col = torch.full((B, 1), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    ids = torch.cat([input_ids, pad_col], dim=1).scatter(1, n, torch.where(grow, last, pad_col))
    mask = torch.cat([attention_mask, torch.zeros_like(attention_mask[:, :1])], dim=1)
    mask = mask.scatter(1, n, grow.to(mask.dtype))
    width = T + 1 if max_len is None else min(T + 1, max(max_len, T))
    return ids[:, :width], mask[:, :width]


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's rightmost real position [B] (transformers' rule for a sequence's score; either padding side)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * (attention_mask != 0)).argmax(dim=1)


def last_token_scores(model: nn.Module, input_ids: torch.Tensor,
                      attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A reward model's scores [B, num_labels] (fp32) of each row at its last real token. The head's output over every
    position is [B, T, num_labels] (num_labels is small: nothing is saved by scoring fewer positions), read with a
    gather: the same graph for any padding."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    scores = model(input_ids, attention_mask=attention_mask)
    idx = last_token_index(attention_mask)[:, None, None].expand(-1, 1, scores.shape[-1])
    return scores.gather(1, idx).squeeze(1).float()
