"""A reward model's accuracy on preference pairs: `python eval_lm.py --ckpt=<reward model> --preferences=pairs.jsonl`.

Each pair (DPO's records: {"prompt" | "conversations", "chosen", "rejected"}, rendered and tokenized as the trainer
renders them: data_preprocess/pretokenize_dpo_data.py) is scored as --task_type=reward scores it: prompt + reply
through its final token, the score at the last real token (model/score_head.py). Reported per file: `acc` (the share
of pairs whose chosen reply scores above the rejected one, RewardBench's accuracy), the mean margin r_c - r_r and the
mean scores, over the pairs kept (records skipped or pairs dropped as over-long are counted, as the trainer counts
them).

Owns: `pair_scores` (a DPO-collated batch's two scores per pair, one forward: the trainer's reward task uses it too)
and `score_preferences`. Must never: score a pair differently from the trainer.
"""
from __future__ import annotations

from typing import Any

import torch

from model.score_head import last_token_scores, whole_rows
from utils.device import to_device


def pair_scores(model, batch: dict, device, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores [P], rejected scores [P]) of a DPO-collated batch, both sides in one forward (2P rows: the
    collate pads them to one length), each row whole (model/score_head.py whole_rows) within `max_len` tokens."""
    sides = [[to_device(batch[f"{side}_{k}"], device) for k in ("input_ids", "labels", "attention_mask")]
             for side in ("chosen", "rejected")]
    ids, mask = whole_rows(*(torch.cat([a, b]) for a, b in zip(*sides)), max_len=max_len)
    scores = last_token_scores(model, ids, mask)[:, 0]
    return scores[:ids.shape[0] // 2], scores[ids.shape[0] // 2:]


@torch.no_grad()
def score_preferences(model: Any, pairs: Any, collate: Any, path: str, max_len: int, batch_size: int,
                      device: Any) -> dict:
    """{"file", "acc", "margin", "chosen", "rejected", "n", "skipped", "dropped"} of `pairs` (a DPODataset of `path`:
    items by index, its `stats` the reader's counts) under the reward model `model`, `batch_size` pairs a forward
    (`collate`: dpo_collate)."""
    chosen, rejected = [], []
    for start in range(0, len(pairs), batch_size):
        batch = collate([pairs[i] for i in range(start, min(start + batch_size, len(pairs)))])
        c, r = pair_scores(model, batch, device, max_len)
        chosen.append(c.cpu())
        rejected.append(r.cpu())
    c, r = torch.cat(chosen).double(), torch.cat(rejected).double()
    stats = pairs.stats
    return {"file": path, "acc": float((c > r).double().mean()), "margin": float((c - r).mean()),
            "chosen": float(c.mean()), "rejected": float(r.mean()), "n": int(c.numel()),
            "skipped": sum(int(v) for v in stats["skipped"].values()), "dropped": int(stats["dropped_overlong"])}
