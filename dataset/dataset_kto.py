"""KTO's examples from preference pairs: `KTODataset`, `kto_collate`, `build_kto_splits`.

Owns: turning the DPO pairs (`dataset.dataset_dpo.DPODataset`, a pretokenized DPO folder or raw pair records) into
KTO's unpaired examples, as TRL's `unpair_preference_dataset` does: each pair gives a desirable example (prompt +
chosen reply) and an undesirable one (prompt + rejected reply); and, per example, the mismatched row KTO estimates
its KL term on (TRL's KL dataset): the example's prompt followed by the reply of the next example in the micro-batch
(the last takes the first's), labels on that reply only, its tail cut to the row length.
Must never: tokenize (the pairs come tokenized), or label a prompt token.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.data import Dataset

from dataset.chat_dataset import IndexedSubset, split_indices
from dataset.dataset_dpo import DPODataset
from utils.constants import IGNORE_INDEX


class KTODataset(DPODataset):
    """The DPO pairs, each item its two branches unshifted: {"chosen_ids", "chosen_labels", "rejected_ids",
    "rejected_labels"} (labels: the token's own id on the final reply, -100 before it)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for side, (ids, labels) in zip(("chosen", "rejected"), self.token_spans(i)):
            out[f"{side}_ids"], out[f"{side}_labels"] = ids, labels
        return out


def _reply_start(labels: torch.Tensor) -> int:
    """The position of a row's first labelled token (where its reply starts)."""
    return int((labels != IGNORE_INDEX).nonzero()[0, 0])


def _pad(rows: list[tuple[torch.Tensor, torch.Tensor]], pad_id: int, pad_to: Optional[int], prefix: str
         ) -> dict[str, torch.Tensor]:
    """Unshifted (ids, labels) rows -> shifted, padded `<prefix>input_ids`, `<prefix>labels`, `<prefix>attention_mask`
    [N, T] (T the longest row less one, at least pad_to)."""
    T = max(max(ids.numel() - 1 for ids, _ in rows), pad_to or 0)
    ids_out = torch.full((len(rows), T), pad_id, dtype=torch.long)
    lab_out = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for b, (ids, labels) in enumerate(rows):
        n = ids.numel() - 1
        ids_out[b, :n], lab_out[b, :n], mask[b, :n] = ids[:-1], labels[1:], 1
    return {f"{prefix}input_ids": ids_out, f"{prefix}labels": lab_out, f"{prefix}attention_mask": mask}


def kto_collate(pad_id: int, max_seq_len: int, pad_to: Optional[int] = None, kl_rows: bool = True
                ) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """B pairs -> 2B examples (the B chosen rows, desirable, then the B rejected rows): input_ids / labels /
    attention_mask [2B, T] (shifted as the SFT rows), desirable [2B] bool; with `kl_rows`, the mismatched rows
    kl_input_ids / kl_labels / kl_attention_mask [2B, T'] (example k's prompt + example k+1's reply, at most
    max_seq_len + 1 tokens: the reply's tail cut)."""
    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        rows = [(it[f"{side}_ids"], it[f"{side}_labels"]) for side in ("chosen", "rejected") for it in items]
        out = _pad(rows, pad_id, pad_to, "")
        out["desirable"] = torch.tensor([True] * len(items) + [False] * len(items))
        if kl_rows:
            mismatched = []
            for k, (ids, labels) in enumerate(rows):
                p = _reply_start(labels)
                other_ids, other_labels = rows[(k + 1) % len(rows)]
                q = _reply_start(other_labels)
                kl_ids = torch.cat((ids[:p], other_ids[q:]))[:max_seq_len + 1]
                kl_labels = torch.cat((torch.full((p,), IGNORE_INDEX), other_labels[q:]))[:max_seq_len + 1]
                mismatched.append((kl_ids, kl_labels))
            out.update(_pad(mismatched, pad_id, pad_to, "kl_"))
        return out
    return collate


def build_kto_splits(data, max_seq_len: int, val_ratio: float = 0.01, seed: int = 0, pad_to: Optional[int] = None,
                     kl_rows: bool = True) -> tuple[Dataset, Dataset, Callable]:
    """(train, val, collate_fn) of KTO examples from DPO pairs (`data` a pretokenized DPO folder or in-memory
    `ChatTokens`); the split is by pair, so a pair's two examples stay together."""
    ds = KTODataset(data, max_seq_len)
    tr, va = split_indices(len(ds), val_ratio, seed)
    return IndexedSubset(ds, tr), IndexedSubset(ds, va), kto_collate(ds.pad_id, ds.max_seq_len, pad_to, kl_rows)
