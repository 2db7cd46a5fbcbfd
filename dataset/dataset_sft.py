"""SFT samples: `SFTDataset`, padding collate, optional packing, and train/val splits.

Owns: SFT samples read from a pretokenized folder (see `data_preprocess.pretokenize_sft_data`) through
memmaps, or from the same arrays in memory (`tokenize_sft_records` there makes them of raw records),
both through `dataset.chat_dataset.ChatTokenDataset`; shifting (input_ids = ids[:-1], labels =
labels[1:], so labels[t] is the target of position t, like the pretraining items); padding (pad id
from the tokenizer meta, labels -100, attention_mask 1/0); and packing several samples into one
fixed-length row.

Packed rows carry: input_ids/labels [L] (-100 on padding; no target crosses a sample since each
sample was shifted on its own), attention_mask [L] (1 on tokens, 0 on padding), position_ids [L]
restarting at 0 for every sample, doc_ids [L] (sample number within the row, -1 on padding).
`packed_collate` adds cu_seqlens (int32, cumulative segment boundaries over the flattened batch,
padding as its own segment) and max_seqlen, for varlen attention. A model that only reads
attention_mask/position_ids still attends across samples in a row; per-sample isolation needs
doc_ids or cu_seqlens.

Must never: tokenize raw records (that is `data_preprocess/`'s), read labels from the ids (trap 2),
or invent a pad id.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from data_preprocess.chat_tokens import SFT, ChatTokens
from data_preprocess.shard_format import DataError
from dataset.chat_dataset import ChatTokenDataset, IndexedSubset, right_pad, split_indices
from utils.constants import IGNORE_INDEX


class SFTDataset(ChatTokenDataset):
    """`source`: a pretokenized SFT dir (has sft_meta.json), or the `ChatTokens` that
    `data_preprocess.pretokenize_sft_data.tokenize_sft_records` made of raw records."""
    kind = SFT

    def __init__(self, source: "str | ChatTokens", max_seq_len: Optional[int] = None):
        super().__init__(source, max_seq_len)
        if len(self.samples) == 0:
            raise DataError(f"{self.path}: no SFT samples")

    @property
    def samples(self) -> np.ndarray:
        """int64 [n, 4]: token offset, length, file id, position in that file."""
        return self.index

    def length(self, i: int) -> int:
        """Model positions of sample i (stored tokens - 1)."""
        return int(self.samples[i, 1]) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        [(x, y)] = self.branches(i)
        return {"input_ids": x, "labels": y}


def pad_collate(pad_id: int, pad_to: Optional[int] = None) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """Right-pad variable-length items: ids with pad_id, labels with -100, attention_mask 1/0."""
    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        ids, labels, mask = right_pad([it["input_ids"] for it in items], [it["labels"] for it in items], pad_id,
                                      pad_to)
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}
    return collate


class PackedSFTDataset(Dataset):
    """Consecutive SFT samples packed greedily (in order) into rows of `seq_len` positions."""

    def __init__(self, sft: SFTDataset, seq_len: int):
        self.sft, self.seq_len, self.pad_id = sft, int(seq_len), sft.pad_id
        lengths = np.asarray(sft.samples[:, 1], dtype=np.int64) - 1
        if len(lengths) and lengths.max() > self.seq_len:
            raise DataError(f"an SFT sample has {int(lengths.max())} positions > pack length {seq_len}")
        starts, fill = [0], 0
        for i, n in enumerate(lengths):  # O(n samples) ints once; SFT sets are small next to pretraining
            if fill + n > self.seq_len:
                starts.append(i)
                fill = 0
            fill += int(n)
        self.row_starts = np.asarray(starts + [len(lengths)] if len(lengths) else [0], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def __getitem__(self, r: int) -> dict[str, torch.Tensor]:
        L = self.seq_len
        out = {"input_ids": torch.full((L,), self.pad_id, dtype=torch.long),
               "labels": torch.full((L,), IGNORE_INDEX, dtype=torch.long),
               "attention_mask": torch.zeros(L, dtype=torch.long),
               "position_ids": torch.zeros(L, dtype=torch.long),
               "doc_ids": torch.full((L,), -1, dtype=torch.long)}
        pos = 0
        for d, i in enumerate(range(int(self.row_starts[r]), int(self.row_starts[r + 1]))):
            it = self.sft[i]
            n = it["input_ids"].numel()
            out["input_ids"][pos:pos + n] = it["input_ids"]
            out["labels"][pos:pos + n] = it["labels"]
            out["attention_mask"][pos:pos + n] = 1
            out["position_ids"][pos:pos + n] = torch.arange(n)
            out["doc_ids"][pos:pos + n] = d
            pos += n
        return out


def packed_collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
    B, L = batch["doc_ids"].shape
    bounds = [0]
    for b in range(B):
        d = batch["doc_ids"][b]
        change = (torch.nonzero(d[1:] != d[:-1]).flatten() + 1).tolist()
        bounds += [b * L + c for c in change] + [(b + 1) * L]
    cu = torch.tensor(bounds, dtype=torch.int32)
    batch["cu_seqlens"] = cu
    batch["max_seqlen"] = torch.tensor(int((cu[1:] - cu[:-1]).max()))
    return batch


def build_sft_splits(data: "str | ChatTokens", max_seq_len: int, val_ratio: float = 0.01,
                     seed: int = 0, pack: bool = False) -> tuple[Dataset, Dataset, Callable]:
    """(train, val, collate_fn) for the trainer; `data` a pretokenized folder or in-memory `ChatTokens`."""
    ds = SFTDataset(data, max_seq_len)
    tr, va = split_indices(len(ds), val_ratio, seed)
    train, val = IndexedSubset(ds, tr), IndexedSubset(ds, va)
    if pack:
        # pack each split on its own so no row mixes train and val samples
        return (_PackedView(ds, tr, max_seq_len), _PackedView(ds, va, max_seq_len), packed_collate)
    return train, val, pad_collate(ds.pad_id)


class _PackedView(PackedSFTDataset):
    def __init__(self, ds: SFTDataset, idx: np.ndarray, seq_len: int):
        sub = _SubsetSFT(ds, idx)
        super().__init__(sub, seq_len)  # type: ignore[arg-type]


class _SubsetSFT:
    def __init__(self, ds: SFTDataset, idx: np.ndarray):
        self.ds, self.idx, self.pad_id = ds, idx, ds.pad_id
        self.samples = np.asarray(ds.samples)[idx] if len(idx) else np.zeros((0, 4), np.int64)

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.ds[int(self.idx[i])]
