"""DPO preference pairs: `DPODataset`, `dpo_collate`, `build_dpo_splits`.

Owns: reading DPO pairs, from a pretokenized folder (`data_preprocess.pretokenize_dpo_data`, through
memmaps) or from the same arrays in memory (`tokenize_dpo_records` there renders raw {"prompt" |
"conversations", "chosen", "rejected"} records into two chat branches, prompt + assistant reply each,
with labels only on the final reply: its content and <|im_end|>; -100 on every prompt token, including
earlier assistant turns of a multi-turn prompt), both through `dataset.chat_dataset.ChatTokenDataset`;
each branch shifted like the SFT items, and the pair's "margin" where the data has margins (0.0 where its record
had none: what a reward model's loss subtracts; batches carry it where asked); the pairs' counts (over-long pairs
truncated or dropped, skipped records, as the pretokenizer counted them per file) totalled in `self.stats` and
logged.

Must never: tokenize raw records (that is `data_preprocess/`'s), label prompt tokens, or pad with an
id that is not the tokenizer's pad id.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch.utils.data import Dataset

from data_preprocess.chat_tokens import DPO, ChatTokens, drop_totals
from data_preprocess.shard_format import DataError
from dataset.chat_dataset import ChatTokenDataset, IndexedSubset, right_pad, split_indices

log = logging.getLogger(__name__)


class DPODataset(ChatTokenDataset):
    """`source`: a pretokenized DPO folder (has dpo_meta.json, from `pretokenize_dpo`), read through
    memmaps; or the `ChatTokens` that `data_preprocess.pretokenize_dpo_data.tokenize_dpo_records` made of
    raw records with the same function, so both give the same items."""
    kind = DPO

    def __init__(self, source: "str | ChatTokens", max_seq_len: Optional[int] = None):
        super().__init__(source, max_seq_len)
        self.max_seq_len = int(self.meta["max_seq_len"])
        self.stats = drop_totals(self.meta["files"])
        if self.stats["dropped_overlong"] or self.stats["skipped"]:
            log.info("%s: DPO pairs kept %d, %s", self.path, len(self.index), self.stats)
        if len(self.index) == 0:
            raise DataError(f"{self.path}: no usable DPO pair ({self.stats})")

    @property
    def sources(self) -> list[tuple[str, int]]:
        return [self.source(i) for i in range(len(self))]

    @property
    def num_with_margin(self) -> int:
        """Pairs whose record carried a "margin" (0 without a values file)."""
        return int(self.meta.get("num_with_margin", 0)) if self.values is not None else 0

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for side, (x, y) in zip(("chosen", "rejected"), self.branches(i)):
            out[f"{side}_input_ids"], out[f"{side}_labels"] = x, y
        if self.values is not None:
            out["margin"] = torch.tensor(float(self.values[i, 0]), dtype=torch.float64)
        return out


def dpo_collate(pad_id: int, pad_to: Optional[int] = None,
                margins: bool = False) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """Pad chosen and rejected to one common length T (so they can be concatenated into one
    forward pass), at least `pad_to`: *_input_ids with pad_id, *_labels with -100, *_attention_mask 1/0;
    with `margins`, "margin" [B] float32 (the pairs' margins, 0.0 where a record had none: a reward model's)."""
    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        T = max(max(it["chosen_input_ids"].numel(), it["rejected_input_ids"].numel()) for it in items)
        T = max(T, pad_to or 0)
        out: dict[str, torch.Tensor] = {}
        for side in ("chosen", "rejected"):
            out[f"{side}_input_ids"], out[f"{side}_labels"], out[f"{side}_attention_mask"] = right_pad(
                [it[f"{side}_input_ids"] for it in items], [it[f"{side}_labels"] for it in items], pad_id, T)
        if margins:
            out["margin"] = torch.tensor([float(it.get("margin", 0.0)) for it in items], dtype=torch.float32)
        return out
    return collate


def build_dpo_splits(data: "str | ChatTokens", max_seq_len: int, val_ratio: float = 0.01,
                     seed: int = 0, pad_to: Optional[int] = None,
                     margins: bool = False) -> tuple[Dataset, Dataset, Callable]:
    """(train, val, collate_fn) for the trainer; `data` a pretokenized folder or in-memory `ChatTokens`; rows
    padded to at least `pad_to`; `margins`: batches carry the pairs' margins (dpo_collate)."""
    ds = DPODataset(data, max_seq_len)
    if ds.num_with_margin:
        log.info("%s: %d of %d DPO pairs carry a margin%s", ds.path, ds.num_with_margin, len(ds),
                 "" if margins else " (used by --task_type=reward only)")
    tr, va = split_indices(len(ds), val_ratio, seed)
    return IndexedSubset(ds, tr), IndexedSubset(ds, va), dpo_collate(ds.pad_id, pad_to, margins)
