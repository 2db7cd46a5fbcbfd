"""What the SFT and DPO datasets share: reading pretokenized chat data, and train/val splits.

Owns: `ChatTokenDataset`, the rows of a pretokenized SFT / DPO folder (`data_preprocess.chat_tokens`
layout, read through memmaps that each DataLoader worker opens for itself, every field and row checked
once: a damaged file is a DataError naming it) or of the same arrays in memory (`ChatTokens`, which
`data_preprocess.pretokenize_{sft,dpo}_data.tokenize_{sft,dpo}_records` make of raw records); each
branch of a row shifted (input_ids = ids[:-1], labels = labels[1:]); `IndexedSubset` and
`split_indices` (disjoint train/val sample ids); `right_pad`, the one padding of token rows into a batch (the SFT,
DPO and KTO collates, GRPO's reward model).

Must never: tokenize or render a chat (raw records are `data_preprocess/`'s), read labels from the ids
(trap 2), or invent a pad id.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from data_preprocess.chat_tokens import VALUES_NAME, ChatKind, ChatTokens, check_not_other_kind, is_pretokenized
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


def load_npy(fpath: str, mmap_mode: Optional[str] = None) -> np.ndarray:
    """A pretokenized folder's .npy file; a DataError naming it when it cannot be read."""
    try:
        return np.load(fpath, mmap_mode=mmap_mode)
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"{fpath}: unreadable ({type(e).__name__}: {' '.join(str(e).split())[:160]}); "
                        "re-run the pretokenizer") from e


def load_rows(path: str, name: str, cols: int, rows: int, spans: tuple[tuple[int, int], ...],
              num_tokens: int, n_files: int) -> np.ndarray:
    """`name` (samples.npy / pairs.npy: int64 [rows, cols]) memory-mapped and checked once: every
    (offset, length) column pair in `spans` inside the `num_tokens` tokens, lengths >= 2, and the file
    id column (cols - 2) one of the meta's files. A damaged row is a DataError naming the file and row."""
    fpath = os.path.join(path, name)
    arr = load_npy(fpath, mmap_mode="r")
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


def load_values(path: str, kind: ChatKind, meta: dict) -> Optional[np.ndarray]:
    """The rows' float values (VALUES_NAME: float64 [n, len(kind.values)], every one finite) where the meta lists
    them ("values_columns"), else None; a damaged file is a DataError naming it (and the row)."""
    cols = meta.get("values_columns")
    if cols is None:
        return None
    fpath, rows = os.path.join(path, VALUES_NAME), int(meta[kind.count_key])
    if cols != list(kind.values):
        raise DataError(f"{os.path.join(path, kind.meta_name)}: values_columns {cols!r}, this version reads "
                        f"{list(kind.values)!r}; re-run the pretokenizer")
    arr = load_npy(fpath)
    if arr.dtype != np.float64 or arr.shape != (rows, len(cols)):
        raise DataError(f"{fpath}: expected float64 [{rows}, {len(cols)}] (the meta's count), found {arr.dtype} "
                        f"{list(arr.shape)}; re-run the pretokenizer")
    bad = ~np.isfinite(arr).all(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataError(f"{fpath}: row {i} {arr[i].tolist()} is not finite; re-run the pretokenizer")
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


class ChatTokenDataset(Dataset):
    """Rows of pretokenized `kind` data: `source` a pretokenized folder (its meta file present) or
    `ChatTokens` in memory. `max_seq_len`: a folder made for a longer one is refused. Sets `meta`,
    `index` (int64 [n, kind.cols]), `values` (float64 [n, len(kind.values)] or None), `pad_id`, `path`."""
    kind: ChatKind

    def __init__(self, source: "str | ChatTokens", max_seq_len: Optional[int] = None):
        kind = self.kind
        self._ids: Any = None
        self._labels: Any = None
        if isinstance(source, ChatTokens):
            if source.kind is not kind:
                raise DataError(f"{source.path}: {source.kind.units} given where {kind.units} are read")
            self.path, self.meta, self.index = source.path, source.meta, source.index
            self._ids, self._labels = source.ids, source.labels
            self.values = source.values
        else:
            self.path = path = source
            if not is_pretokenized(path, kind):
                check_not_other_kind(path, kind)
                raise DataError(f"{path}: no {kind.meta_name}; raw records are tokenized by "
                                f"data_preprocess.pretokenize_{kind.kind}_data first (its command writes a folder, "
                                f"tokenize_{kind.kind}_records keeps them in memory)")
            meta_path = os.path.join(path, kind.meta_name)
            self.meta = read_pretokenized_meta(path, kind.meta_name, kind.count_key)
            if kind.meta_kind_required and self.meta.get("kind") != kind.kind:
                raise DataError(f"{meta_path}: kind {self.meta.get('kind')!r}, not '{kind.kind}'")
            if max_seq_len is not None and int(max_seq_len) < int(self.meta["max_seq_len"]):
                raise DataError(f"{path}: pretokenized for max_seq_len={self.meta['max_seq_len']}, "
                                f"longer than the requested {max_seq_len}; re-run pretokenize_{kind.kind}_data")
            self._files = token_files(path, self.meta, kind.meta_name)
            self.index = load_rows(path, kind.index_name, kind.cols, self.meta[kind.count_key],
                                   kind.spans, self.meta["num_tokens"], len(self.meta["files"]))
            self.values = load_values(path, kind, self.meta)
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
        return len(self.index)

    def source(self, i: int) -> tuple[str, int]:
        """(input file, record number) row i came from."""
        cols = self.kind.cols
        return self.meta["files"][int(self.index[i, cols - 2])]["path"], int(self.index[i, cols - 1])

    def branches(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, labels) of every branch of row i, shifted: labels[t] is the target of position t."""
        return [(x[:-1], y[1:]) for x, y in self.token_spans(i)]

    def token_spans(self, i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(ids, labels) of every branch of row i as stored (unshifted: labels[t] is token t's own id where it is a
        target, -100 elsewhere)."""
        row = [int(v) for v in self.index[i]]
        ids, labels = self._arrays()
        out = []
        for o, n in self.kind.spans:
            off, length = row[o], row[n]
            out.append((torch.from_numpy(np.asarray(ids[off:off + length], dtype=np.int64)),
                        torch.from_numpy(np.asarray(labels[off:off + length], dtype=np.int64))))
        return out


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


def right_pad(ids: Sequence, labels: Optional[Sequence] = None, pad_id: int = 0, pad_to: Optional[int] = None
              ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """(input_ids, labels, attention_mask), each [rows, T] long: rows of token ids (1-D tensors or lists) and their
    labels (None: no labels) right-padded to T, the longest row's length and at least `pad_to`; ids with `pad_id`,
    labels with -100, the mask 1 on the real tokens."""
    T = max([len(r) for r in ids] + [pad_to or 0])
    out = torch.full((len(ids), T), int(pad_id), dtype=torch.long)
    lab = torch.full((len(ids), T), IGNORE_INDEX, dtype=torch.long) if labels is not None else None
    mask = torch.zeros((len(ids), T), dtype=torch.long)
    for b, row in enumerate(ids):
        n = len(row)
        out[b, :n] = torch.as_tensor(row, dtype=torch.long)
        mask[b, :n] = 1
        if lab is not None:
            lab[b, :n] = torch.as_tensor(labels[b], dtype=torch.long)
    return out, lab, mask
