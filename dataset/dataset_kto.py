"""KTO's examples: `KTOExamples` (labelled examples, data_preprocess/pretokenize_kto_data.py), `KTOPairs` (DPO
pairs unpaired), `kto_collate`, `build_kto_splits`.

Owns: reading KTO's labelled examples (a pretokenized KTO folder or the same arrays in memory), and turning DPO pairs
(`dataset.dataset_dpo.DPODataset`'s) into KTO's examples as TRL's `unpair_preference_dataset` does: each pair gives a
desirable example (prompt + chosen reply) and an undesirable one (prompt + rejected reply); and, per example, the
mismatched row KTO estimates its KL term on (TRL's KL dataset): the example's prompt followed by the reply of the next
example in the micro-batch (the last takes the first's), labels on that reply only, its tail cut to the row length.
Must never: tokenize (the examples come tokenized), or label a prompt token.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.data import Dataset

from data_preprocess.chat_tokens import KTO, drop_totals
from data_preprocess.shard_format import DataError
from dataset.chat_dataset import ChatTokenDataset, IndexedSubset, right_pad, split_indices
from dataset.dataset_dpo import DPODataset
from utils.constants import IGNORE_INDEX


class KTOExamples(ChatTokenDataset):
    """KTO's labelled examples: `source` a pretokenized KTO folder (kto_meta.json) or the `ChatTokens` that
    `tokenize_kto_records` made of raw records. Each item {"ids", "labels" (unshifted), "desirable" (bool)}."""
    kind = KTO

    def __init__(self, source, max_seq_len: Optional[int] = None):
        super().__init__(source, max_seq_len)
        self.max_seq_len = int(self.meta["max_seq_len"])
        if len(self.index) == 0:
            raise DataError(f"{self.path}: no usable KTO example ({drop_totals(self.meta['files'])})")

    def __getitem__(self, i: int) -> dict:
        (ids, labels), = self.token_spans(i)
        return {"ids": ids, "labels": labels, "desirable": bool(self.index[i, 2])}


def _examples(item: dict) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    """An item's examples: a labelled example's one, or a pair's two (chosen desirable, rejected not)."""
    if "ids" in item:
        return [(item["ids"], item["labels"], item["desirable"])]
    return [(item["chosen_ids"], item["chosen_labels"], True), (item["rejected_ids"], item["rejected_labels"], False)]


class KTOPairs(DPODataset):
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
    ids_out, lab_out, mask = right_pad([ids[:-1] for ids, _ in rows], [labels[1:] for _, labels in rows], pad_id,
                                       pad_to)
    return {f"{prefix}input_ids": ids_out, f"{prefix}labels": lab_out, f"{prefix}attention_mask": mask}


def kto_collate(pad_id: int, max_seq_len: int, pad_to: Optional[int] = None, kl_rows: bool = True
                ) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """Items -> their N examples (labelled examples in order; B pairs: the B chosen rows, desirable, then the B
    rejected rows): input_ids / labels / attention_mask [N, T] (shifted as the SFT rows), desirable [N] bool; with
    `kl_rows`, the mismatched rows kl_input_ids / kl_labels / kl_attention_mask [N, T'] (example k's prompt +
    example k+1's reply, at most max_seq_len + 1 tokens: the reply's tail cut)."""
    def collate(items: list[dict]) -> dict[str, torch.Tensor]:
        per_item = [_examples(it) for it in items]
        width = max(len(e) for e in per_item)
        examples = [e[j] for j in range(width) for e in per_item if j < len(e)]  # (pairs: chosen, then rejected)
        rows = [(ids, labels) for ids, labels, _ in examples]
        out = _pad(rows, pad_id, pad_to, "")
        out["desirable"] = torch.tensor([d for _, _, d in examples])
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
                     kl_rows: bool = True, paired: bool = False) -> tuple[Dataset, Dataset, Callable]:
    """(train, val, collate_fn) of KTO examples (`data` a pretokenized folder or in-memory `ChatTokens`: labelled
    examples, or with `paired` DPO pairs, split by pair so that a pair's two examples stay together)."""
    ds = KTOPairs(data, max_seq_len) if paired else KTOExamples(data, max_seq_len)
    tr, va = split_indices(len(ds), val_ratio, seed)
    return IndexedSubset(ds, tr), IndexedSubset(ds, va), kto_collate(ds.pad_id, ds.max_seq_len, pad_to, kl_rows)
