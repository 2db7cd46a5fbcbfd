"""DPO preference pairs: `DPODataset`, `dpo_collate`, `build_dpo_splits`.

Owns: reading DPO pairs, pretokenized (`data_preprocess.pretokenize_dpo_data`, through memmaps) or
raw {"prompt" | "conversations", "chosen", "rejected"} records (shapes in
`data_preprocess.sft_format`) rendered by the same `tokenize_dpo_files` into two chat branches,
prompt + assistant reply each, with labels only on the final reply (its content and <|im_end|>;
-100 on every prompt token, including earlier assistant turns of a multi-turn prompt), shifted
like the SFT items.

Over-long pairs (either branch > max_seq_len+1 tokens): "truncate" cuts the reply's tail and
keeps the pair if both replies keep at least one target token; "drop" drops it. Counted in
`self.stats` and logged.

Must never: label prompt tokens, or pad with an id that is not the tokenizer's pad id.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from data_preprocess.shard_format import DataError
from utils.constants import IGNORE_INDEX

log = logging.getLogger(__name__)


class DPODataset(Dataset):
    """`path`: a pretokenized DPO folder (has dpo_meta.json, from `pretokenize_dpo_data`), read
    through memmaps; or raw records (file or folder) with `tokenizer_dir` and `max_seq_len`,
    tokenized in memory at construction by the same function, so both give the same items."""

    def __init__(self, path: str, tokenizer_dir: Optional[str] = None, max_seq_len: Optional[int] = None,
                 overlong: str = "truncate", strict: bool = False):
        from data_preprocess.pretokenize_dpo_data import DPO_META, dpo_stats
        self.path = path
        meta_path = os.path.join(path, DPO_META)
        if os.path.isdir(path) and os.path.exists(meta_path):
            from dataset.dataset_sft import load_rows, read_pretokenized_meta, token_files
            self.meta = read_pretokenized_meta(path, DPO_META, "num_pairs")
            if self.meta.get("kind") != "dpo":
                raise DataError(f"{meta_path}: kind {self.meta.get('kind')!r}, not 'dpo'")
            if max_seq_len is not None and int(max_seq_len) < int(self.meta["max_seq_len"]):
                raise DataError(f"{path}: pretokenized for max_seq_len={self.meta['max_seq_len']}, "
                                f"longer than the requested {max_seq_len}; re-run pretokenize_dpo_data")
            self._files = token_files(path, self.meta, DPO_META)
            self.index = load_rows(path, "pairs.npy", 6, self.meta["num_pairs"], ((0, 1), (2, 3)),
                                   self.meta["num_tokens"], len(self.meta["files"]))
            self._ids: Any = None
            self._labels: Any = None
        else:
            if os.path.isdir(path) and os.path.exists(os.path.join(path, "sft_meta.json")):
                raise DataError(f"{path} holds pretokenized SFT samples, not DPO pairs (--task_type=sft, or "
                                "pretokenize the pairs with data_preprocess.pretokenize_dpo_data)")
            if tokenizer_dir is None or max_seq_len is None:
                raise DataError(f"{path}: no {DPO_META}; raw records need tokenizer_dir and max_seq_len")
            from data_preprocess.pretokenize_dpo_data import tokenize_dpo_files
            from data_preprocess.readers import RECORD_KINDS, find_input_files
            from data_preprocess.sft_format import make_chat_encoder
            encode, tmeta = make_chat_encoder(tokenizer_dir)
            files = find_input_files(path, kinds=RECORD_KINDS, what="DPO")
            ids, labels, self.index, stats = tokenize_dpo_files(files, encode, int(max_seq_len), overlong, strict)
            self.meta = {"pad_id": int(tmeta["special_tokens"]["pad"]["id"]), "files": stats,
                         "num_pairs": len(self.index), "max_seq_len": int(max_seq_len)}
            self._ids, self._labels = ids, labels
        self.pad_id = int(self.meta["pad_id"])
        self.max_seq_len = int(self.meta["max_seq_len"])
        self.stats = dpo_stats(self.meta["files"])
        if self.stats["dropped_overlong"] or self.stats["skipped"]:
            log.info("%s: DPO pairs kept %d, %s", path, len(self.index), self.stats)
        if len(self.index) == 0:
            raise DataError(f"{path}: no usable DPO pair ({self.stats})")

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._ids is None:  # opened lazily: each DataLoader worker maps its own
            n = int(self.meta["num_tokens"])
            self._ids = np.memmap(self._files["ids"][0], dtype=self._files["ids"][1], mode="r", shape=(n,))
            self._labels = np.memmap(self._files["labels"][0], dtype="<i4", mode="r", shape=(n,))
        return self._ids, self._labels

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        if "_files" in d:
            d["_ids"] = d["_labels"] = None
        return d

    def __len__(self) -> int:
        return len(self.index)

    def source(self, i: int) -> tuple[str, int]:
        """(input file, record number) pair i came from."""
        return self.meta["files"][int(self.index[i, 4])]["path"], int(self.index[i, 5])

    @property
    def sources(self) -> list[tuple[str, int]]:
        return [self.source(i) for i in range(len(self))]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = [int(v) for v in self.index[i]]
        ids, labels = self._arrays()
        out: dict[str, torch.Tensor] = {}
        for side, (off, n) in (("chosen", row[0:2]), ("rejected", row[2:4])):
            x = torch.from_numpy(np.asarray(ids[off:off + n], dtype=np.int64))
            y = torch.from_numpy(np.asarray(labels[off:off + n], dtype=np.int64))
            out[f"{side}_input_ids"], out[f"{side}_labels"] = x[:-1], y[1:]
        return out


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


def build_dpo_splits(data_dir: str, tokenizer_dir: Optional[str], max_seq_len: int, val_ratio: float = 0.01,
                     seed: int = 0) -> tuple[Dataset, Dataset, Callable]:
    """(train, val, collate_fn) for the trainer; pretokenized or raw `data_dir`."""
    from dataset.dataset_sft import IndexedSubset, split_indices
    ds = DPODataset(data_dir, tokenizer_dir, max_seq_len)
    tr, va = split_indices(len(ds), val_ratio, seed)
    return IndexedSubset(ds, tr), IndexedSubset(ds, va), dpo_collate(ds.pad_id)
