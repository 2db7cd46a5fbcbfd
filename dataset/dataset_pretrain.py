"""Pretraining datasets over token shards: `PretokDataset` and `PretokDatasetWithIndex`.

Owns: reading fixed-length samples (L+1 tokens -> input_ids = s[:-1], labels = s[1:]) from the
concatenation of all shards of a directory (positioned reads through lazily opened file
descriptors; the index arrays are np.memmaps), so memory stays flat whatever the corpus size
and a sample may span several shards.

Must never: keep a Python list of all samples, hold open file descriptors across pickling (each
DataLoader worker opens its own), guess the id dtype (it comes from the sidecars), or read
through an index that was built for other shards or another L.
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from data_preprocess.build_pretrain_sample_index_map import (index_dir_for, load_index_meta,
                                                             num_samples_for)
from data_preprocess.shard_format import DataError, ShardInfo, check_ids, list_shards


class TokenStream:
    """All shards of a directory as one read-only array of token ids."""

    def __init__(self, shard_dir: str, shards: Optional[list[ShardInfo]] = None):
        self.shard_dir = shard_dir
        self.shards = shards if shards is not None else list_shards(shard_dir)
        self.dtype = self.shards[0].dtype
        self.vocab_size = self.shards[0].vocab_size
        sizes = np.array([s.num_tokens for s in self.shards], dtype=np.int64)
        # ends[i] = first global offset after shard i; searchsorted on it finds a token's shard.
        self.ends = np.cumsum(sizes)
        self.starts = self.ends - sizes
        self.total_tokens = int(self.ends[-1]) if len(sizes) else 0
        self._fds: dict[int, int] = {}

    def _fd(self, i: int) -> int:
        fd = self._fds.get(i)
        if fd is None:
            fd = self._fds[i] = os.open(self.shards[i].path, os.O_RDONLY)
        return fd

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start+length) of the stream as int64, crossing shard boundaries.

        Reads with os.preadv into a small buffer rather than slicing an np.memmap: mapped file
        pages count toward the process RSS (and readahead maps far more than a sample), so
        random reads over a memmapped corpus grow RSS towards the corpus size; pread keeps it
        flat and leaves caching to the OS page cache."""
        if start < 0 or start + length > self.total_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside stream of {self.total_tokens}")
        buf = np.empty(length, dtype=self.dtype)
        i = int(np.searchsorted(self.ends, start, side="right"))
        filled = 0
        isz = self.dtype.itemsize
        while filled < length:
            off = start + filled - int(self.starts[i])
            take = min(length - filled, int(self.ends[i]) - (start + filled))
            if take > 0:
                view = memoryview(buf[filled:filled + take]).cast("B")
                got = os.preadv(self._fd(i), [view], off * isz)
                if got != take * isz:
                    raise DataError(f"{self.shards[i].path}: short read ({got} of {take * isz} bytes at "
                                    f"{off * isz}); the shard changed under the reader")
                filled += take
            i += 1
        check_ids(buf, self.vocab_size, self._where(start))  # named shard and offset, before any device copy
        return buf.astype(np.int64)

    def _where(self, start: int):
        def where(k: int) -> str:
            g = start + k
            i = int(np.searchsorted(self.ends, g, side="right"))
            return f"{self.shards[i].path} at token offset {g - int(self.starts[i])}"
        return where

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_fds"] = {}  # file descriptors are reopened in the receiving process
        return d


def _load_offsets(path: str) -> np.ndarray:
    """An index's train.npy / val.npy, memory-mapped; a missing, empty or truncated file is a DataError."""
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as e:  # an empty file: EOFError; a torn header: ValueError
        raise DataError(f"{path}: unreadable sample index ({type(e).__name__}: {' '.join(str(e).split())[:160]}); "
                        "rebuild the index") from e


def _item(tokens: np.ndarray) -> dict[str, torch.Tensor]:
    t = torch.from_numpy(tokens)
    return {"input_ids": t[:-1], "labels": t[1:]}


class PretokDataset(Dataset):
    """Samples i = stream[i*L : i*L + L + 1]; all shards of `data_dir` in name order."""

    def __init__(self, data_dir: str, max_seq_len: int):
        self.data_dir, self.max_seq_len = data_dir, int(max_seq_len)
        self.stream = TokenStream(data_dir)
        self.n = num_samples_for(self.stream.total_tokens, self.max_seq_len)
        if self.n == 0:
            raise DataError(f"{data_dir}: {self.stream.total_tokens} tokens, too few for one sample "
                            f"of {self.max_seq_len + 1}")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not -self.n <= i < self.n:
            raise IndexError(i)
        i %= self.n
        return _item(self.stream.read(i * self.max_seq_len, self.max_seq_len + 1))


class PretokDatasetWithIndex(Dataset):
    """Samples listed in `<data_dir>/index_L<L>/<split>.npy` (int64 start offsets, memory-mapped)."""

    def __init__(self, data_dir: str, max_seq_len: int, split: str = "train"):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.data_dir, self.max_seq_len, self.split = data_dir, int(max_seq_len), split
        shards = list_shards(data_dir)
        self.meta = load_index_meta(data_dir, self.max_seq_len, shards)  # StaleIndexError if changed
        self.stream = TokenStream(data_dir, shards)
        self.path = path = os.path.join(index_dir_for(data_dir, self.max_seq_len), f"{split}.npy")
        self.starts = _load_offsets(path)
        want = self.meta["num_train" if split == "train" else "num_val"]
        if self.starts.dtype != np.int64 or self.starts.ndim != 1 or len(self.starts) != want:
            raise DataError(f"{path}: expected {want} int64 offsets, found {self.starts.shape} {self.starts.dtype}")
        if split == "train" and want == 0:
            raise DataError(f"{path}: the index holds no training sample (num_train=0); rebuild it with a "
                            "smaller --val_ratio / --val_samples")
        # Built sorted: the first and the last offset bound the others (each read checks its own, __getitem__).
        if len(self.starts) and int(self.starts[0]) < 0:
            raise DataError(f"{path}: offset {int(self.starts[0])} at position 0 is negative (damaged index; "
                            "rebuild it)")
        if len(self.starts) and int(self.starts[-1]) + self.max_seq_len + 1 > self.stream.total_tokens:
            raise DataError(f"{path}: offsets run past the {self.stream.total_tokens} tokens of the shards")

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = int(self.starts[i])
        if start < 0 or start + self.max_seq_len + 1 > self.stream.total_tokens:
            raise DataError(f"{self.path}: offset {start} at position {i} is outside the {self.stream.total_tokens} "
                            "tokens of the shards (damaged index; rebuild it)")
        return _item(self.stream.read(start, self.max_seq_len + 1))

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["starts"] = None  # reopen the memmap after unpickling
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self.starts = _load_offsets(self.path)
