"""DPO preference pairs: `DPODataset`, `dpo_collate`, `build_dpo_splits`.

Owns: rendering {"prompt" | "conversations", "chosen", "rejected"} records (shapes in
`data_preprocess.sft_format`) into two chat branches, prompt + assistant reply each, with labels
only on the final reply (its content and <|im_end|>; -100 on every prompt token, including
earlier assistant turns of a multi-turn prompt), shifted like the SFT items.

Over-long pairs (either branch > max_seq_len+1 tokens): "truncate" cuts the reply's tail and
keeps the pair if both replies keep at least one target token; "drop" drops it. Counted in
`self.stats` and logged.

Must never: label prompt tokens, or pad with an id that is not the tokenizer's pad id.
"""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from data_preprocess.readers import RECORD_KINDS, SkipCounter, find_input_files, iter_records
from data_preprocess.sft_format import (RecordError, apply_overlong, dpo_messages, labels_from_mask,
                                        last_run_only, make_chat_encoder)
from data_preprocess.shard_format import DataError
from utils.constants import IGNORE_INDEX

log = logging.getLogger(__name__)


class DPODataset(Dataset):
    """Pairs tokenized in memory at construction (preference sets are small)."""

    def __init__(self, path: str, tokenizer_dir: str, max_seq_len: int, overlong: str = "truncate",
                 strict: bool = False):
        encode, tmeta = make_chat_encoder(tokenizer_dir)
        self.pad_id = int(tmeta["special_tokens"]["pad"]["id"])
        self.max_seq_len = int(max_seq_len)
        self.pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.sources: list[tuple[str, int]] = []
        self.stats = {"dropped_overlong": 0, "truncated": 0, "skipped": {}}
        for path_i in find_input_files(path, kinds=RECORD_KINDS, what="DPO"):
            skips = SkipCounter(strict=strict)
            kept_before, dropped_before = len(self.pairs), self.stats["dropped_overlong"]
            for where, recno, rec in iter_records(path_i, skips):
                try:
                    prompt, chosen, rejected = dpo_messages(rec)
                except RecordError as e:
                    skips.skip(str(e), where)
                    continue
                branches = []
                for reply in (chosen, rejected):
                    ids, mask = encode(prompt + [{"role": "assistant", "content": reply}])
                    ids = np.asarray(ids, dtype=np.int64)
                    labels = labels_from_mask(ids, last_run_only(np.asarray(mask, dtype=bool)))
                    branches.append((ids, labels, apply_overlong(ids, labels, self.max_seq_len, overlong)))
                if any(b[2] is None for b in branches):
                    self.stats["dropped_overlong"] += 1
                    continue
                if any(b[2][0].size < b[0].size for b in branches):
                    self.stats["truncated"] += 1
                (ci, cl), (ri, rl) = branches[0][2], branches[1][2]
                self.pairs.append((ci, cl, ri, rl))
                self.sources.append((path_i, recno))
            for k, v in skips.counts.items():
                self.stats["skipped"][k] = self.stats["skipped"].get(k, 0) + v
            if len(self.pairs) == kept_before:
                log.warning("%s: no usable DPO pair: skipped %s, dropped %d over-long", path_i,
                            dict(skips.counts) or "none", self.stats["dropped_overlong"] - dropped_before)
        if self.stats["dropped_overlong"] or self.stats["skipped"]:
            log.info("%s: DPO pairs kept %d, %s", path, len(self.pairs), self.stats)
        if not self.pairs:
            raise DataError(f"{path}: no usable DPO pair ({self.stats})")

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ci, cl, ri, rl = self.pairs[i]
        t = lambda a: torch.from_numpy(a.astype(np.int64))  # noqa: E731
        return {"chosen_input_ids": t(ci[:-1]), "chosen_labels": t(cl[1:]),
                "rejected_input_ids": t(ri[:-1]), "rejected_labels": t(rl[1:])}


def dpo_collate(pad_id: int) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """Pad chosen and rejected to one common length T (so they can be concatenated into one
    forward pass): *_input_ids with pad_id, *_labels with -100, *_attention_mask 1/0."""
    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        T = max(max(it["chosen_input_ids"].numel(), it["rejected_input_ids"].numel()) for it in items)
        out: dict[str, torch.Tensor] = {}
        for side in ("chosen", "rejected"):
            ids = torch.full((len(items), T), pad_id, dtype=torch.long)
            lab = torch.full((len(items), T), IGNORE_INDEX, dtype=torch.long)
            mask = torch.zeros((len(items), T), dtype=torch.long)
            for b, it in enumerate(items):
                n = it[f"{side}_input_ids"].numel()
                ids[b, :n], lab[b, :n], mask[b, :n] = it[f"{side}_input_ids"], it[f"{side}_labels"], 1
            out[f"{side}_input_ids"], out[f"{side}_labels"], out[f"{side}_attention_mask"] = ids, lab, mask
        return out
    return collate


def build_dpo_splits(data_dir: str, tokenizer_dir: str, max_seq_len: int, val_ratio: float = 0.01,
                     seed: int = 0) -> tuple[Dataset, Dataset, Callable]:
    """(train, val, collate_fn) for the trainer."""
    from dataset.dataset_sft import IndexedSubset, split_indices
    ds = DPODataset(data_dir, tokenizer_dir, max_seq_len)
    tr, va = split_indices(len(ds), val_ratio, seed)
    return IndexedSubset(ds, tr), IndexedSubset(ds, va), dpo_collate(ds.pad_id)
