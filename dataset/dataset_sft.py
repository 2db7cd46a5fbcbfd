"""SFT samples: `SFTDataset`, padding collate, optional packing, and train/val splits.

Owns: reading pretokenized SFT files (see `data_preprocess.pretokenize_sft_data`) through
memmaps, or tokenizing raw records in memory from a tokenizer directory; shifting
(input_ids = ids[:-1], labels = labels[1:], so labels[t] is the target of position t, like the
pretraining items); padding (pad id from the tokenizer meta, labels -100, attention_mask 1/0);
and packing several samples into one fixed-length row.

Packed rows carry: input_ids/labels [L] (-100 on padding; no target crosses a sample since each
sample was shifted on its own), attention_mask [L] (1 on tokens, 0 on padding), position_ids [L]
restarting at 0 for every sample, doc_ids [L] (sample number within the row, -1 on padding).
`packed_collate` adds cu_seqlens (int32, cumulative segment boundaries over the flattened batch,
padding as its own segment) and max_seqlen, for varlen attention. A model that only reads
attention_mask/position_ids still attends across samples in a row; per-sample isolation needs
doc_ids or cu_seqlens.

Must never: read labels from the ids (trap 2), or invent a pad id.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from data_preprocess.shard_format import DataError, int_field, read_json_object, token_dtype_field
from utils.constants import IGNORE_INDEX


def read_pretokenized_meta(path: str, meta_name: str, count_key: str) -> dict:
    """sft_meta.json / dpo_meta.json of a pretokenized folder, the fields the readers use checked for type
    (DataError naming the file and the field): dtype, num_tokens, max_seq_len, pad_id, `count_key`, files."""
    meta_path = os.path.join(path, meta_name)
    meta = read_json_object(meta_path, meta_name)
    token_dtype_field(meta_path, meta)
    for key, low in (("num_tokens", 0), ("max_seq_len", 1), ("pad_id", 0), (count_key, 0)):
        int_field(meta_path, meta, key, minimum=low)
    files = meta.get("files")
    if not isinstance(files, list) or not all(isinstance(f, dict) for f in files):
        raise DataError(f"{meta_path}: field 'files' is not a list of file records")
    return meta


def load_rows(path: str, name: str, cols: int, rows: int, spans: tuple[tuple[int, int], ...],
              num_tokens: int, n_files: int) -> np.ndarray:
    """`name` (samples.npy / pairs.npy: int64 [rows, cols]) memory-mapped and checked once: every
    (offset, length) column pair in `spans` inside the `num_tokens` tokens, lengths >= 2, and the file
    id column (cols - 2) one of the meta's files. A damaged row is a DataError naming the file and row."""
    fpath = os.path.join(path, name)
    try:
        arr = np.load(fpath, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{fpath}: unreadable ({type(e).__name__}: {' '.join(str(e).split())[:160]}); "
                        "re-run the pretokenizer") from e
    if arr.dtype != np.int64 or arr.shape != (rows, cols):
        raise DataError(f"{fpath}: expected int64 [{rows}, {cols}] (the meta's count), found {arr.dtype} "
                        f"{list(arr.shape)}")
    bad = np.zeros(rows, dtype=bool)
    for o, n in spans:
        off, length = np.asarray(arr[:, o]), np.asarray(arr[:, n])
        bad |= (off < 0) | (length < 2) | (off + length > num_tokens)
    fid = np.asarray(arr[:, cols - 2]) if rows else np.zeros(0, np.int64)
    bad |= (fid < 0) | (fid >= n_files)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataError(f"{fpath}: row {i} {np.asarray(arr[i]).tolist()} points outside the {num_tokens} "
                        f"tokens (or the {n_files} files) of the folder; re-run the pretokenizer")
    return arr


def token_files(path: str, meta: dict, meta_name: str) -> dict[str, tuple[str, np.dtype]]:
    """The ids / labels files of a pretokenized SFT or DPO folder, checked against its meta's token count."""
    meta_path = os.path.join(path, meta_name)
    n_tok = int_field(meta_path, meta, "num_tokens")
    files = {"ids": (os.path.join(path, "input_ids.bin"), token_dtype_field(meta_path, meta)),
             "labels": (os.path.join(path, "labels.bin"), np.dtype("<i4"))}
    for fpath, dt in files.values():
        if os.path.getsize(fpath) != n_tok * dt.itemsize:
            raise DataError(f"{fpath}: {os.path.getsize(fpath)} bytes, {meta_name} says {n_tok} tokens of {dt.itemsize} B")
    return files


class SFTDataset(Dataset):
    """`path`: a pretokenized SFT dir (has sft_meta.json), or raw records (file or folder) with
    `tokenizer_dir` and `max_seq_len` (tokenized in memory at construction)."""

    def __init__(self, path: str, tokenizer_dir: Optional[str] = None, max_seq_len: Optional[int] = None,
                 overlong: str = "truncate", strict: bool = False):
        self.path = path
        meta_path = os.path.join(path, "sft_meta.json")
        if os.path.isdir(path) and os.path.exists(meta_path):
            self.meta = read_pretokenized_meta(path, "sft_meta.json", "num_samples")
            if max_seq_len is not None and int(max_seq_len) < int(self.meta["max_seq_len"]):
                raise DataError(f"{path}: pretokenized for max_seq_len={self.meta['max_seq_len']}, "
                                f"longer than the requested {max_seq_len}; re-run pretokenize_sft_data")
            self._files = token_files(path, self.meta, "sft_meta.json")
            self.samples = load_rows(path, "samples.npy", 4, self.meta["num_samples"], ((0, 1),),
                                     self.meta["num_tokens"], len(self.meta["files"]))
            self._ids: Any = None
            self._labels: Any = None
        else:
            if os.path.isdir(path) and os.path.exists(os.path.join(path, "dpo_meta.json")):
                raise DataError(f"{path} holds pretokenized DPO pairs, not SFT samples (--task_type=dpo, or "
                                "pretokenize the records with data_preprocess.pretokenize_sft_data)")
            if tokenizer_dir is None or max_seq_len is None:
                raise DataError(f"{path}: no sft_meta.json; raw records need tokenizer_dir and max_seq_len")
            from data_preprocess.pretokenize_sft_data import tokenize_sft_files
            from data_preprocess.readers import RECORD_KINDS, find_input_files
            from data_preprocess.sft_format import make_chat_encoder
            encode, tmeta = make_chat_encoder(tokenizer_dir)
            files = find_input_files(path, kinds=RECORD_KINDS, what="SFT")
            ids, labels, self.samples, stats = tokenize_sft_files(files, encode, int(max_seq_len), overlong, strict)
            self.meta = {"pad_id": int(tmeta["special_tokens"]["pad"]["id"]), "files": stats,
                         "num_samples": len(self.samples), "max_seq_len": int(max_seq_len)}
            self._ids, self._labels = ids, labels
        if len(self.samples) == 0:
            raise DataError(f"{path}: no SFT samples")
        self.pad_id = int(self.meta["pad_id"])

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
        return len(self.samples)

    def length(self, i: int) -> int:
        """Model positions of sample i (stored tokens - 1)."""
        return int(self.samples[i, 1]) - 1

    def source(self, i: int) -> tuple[str, int]:
        """(input file, record number) sample i came from."""
        return self.meta["files"][int(self.samples[i, 2])]["path"], int(self.samples[i, 3])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        off, n = int(self.samples[i, 0]), int(self.samples[i, 1])
        ids, labels = self._arrays()
        x = torch.from_numpy(np.asarray(ids[off:off + n], dtype=np.int64))
        y = torch.from_numpy(np.asarray(labels[off:off + n], dtype=np.int64))
        return {"input_ids": x[:-1], "labels": y[1:]}


def pad_collate(pad_id: int, pad_to: Optional[int] = None) -> Callable[[list[dict]], dict[str, torch.Tensor]]:
    """Right-pad variable-length items: ids with pad_id, labels with -100, attention_mask 1/0."""
    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        T = max(int(it["input_ids"].numel()) for it in items)
        T = max(T, pad_to or 0)
        B = len(items)
        ids = torch.full((B, T), pad_id, dtype=torch.long)
        labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((B, T), dtype=torch.long)
        for b, it in enumerate(items):
            n = it["input_ids"].numel()
            ids[b, :n], labels[b, :n], mask[b, :n] = it["input_ids"], it["labels"], 1
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


class IndexedSubset(Dataset):
    """A view of `base` through an int64 index array (train/val splits)."""

    def __init__(self, base: Any, indices: np.ndarray):
        self.base, self.indices = base, np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.base[int(self.indices[i])]


def split_indices(n: int, val_ratio: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint (train, val) sample ids; at least one val sample when val_ratio > 0 and n > 1."""
    n_val = int(round(n * val_ratio))
    if val_ratio > 0 and n > 1:
        n_val = max(1, n_val)
    n_val = min(n_val, n - 1)
    perm = np.random.Generator(np.random.PCG64(seed)).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def build_sft_splits(data_dir: str, tokenizer_dir: Optional[str], max_seq_len: int, val_ratio: float = 0.01,
                     seed: int = 0, pack: bool = False) -> tuple[Dataset, Dataset, Callable]:
    """(train, val, collate_fn) for the trainer; pretokenized or raw `data_dir`."""
    ds = SFTDataset(data_dir, tokenizer_dir, max_seq_len)
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
