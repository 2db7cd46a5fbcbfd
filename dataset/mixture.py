"""Weighted mixing of several corpora: `MixtureDataset` and `--data_mix` parsing.

Owns: mapping a mixture index i to (corpus, index in corpus) as a pure function of
(i, seed, weights, corpus sizes) in O(1) time and memory, so a mixture is deterministic and
resumable through the ordinary `ResumableLoader` cursor.

How: indices are cut into blocks of M. Every block holds exactly round(w_k * M) samples of
corpus k (largest-remainder rounding), placed at positions given by a keyed Feistel
permutation of the block. The j-th sample of corpus k overall is its item j mod len_k, so a
small corpus with a large weight is repeated and a large one is sub-sampled: proportions
follow the weights regardless of corpus sizes (exact per block of M).

Must never: keep per-sample lists, or let the draw depend on iteration history.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Optional

import numpy as np
from torch.utils.data import Dataset

from dataset.loader import FeistelPermutation, mix64


class MixtureDataset(Dataset):
    def __init__(self, datasets: Mapping[str, Any], weights: Mapping[str, float], seed: int = 0,
                 num_samples: Optional[int] = None, block_size: Optional[int] = None):
        """`num_samples` defaults to the sum of the corpus sizes (one "epoch" of the mixture)."""
        if set(datasets) != set(weights):
            raise ValueError(f"datasets {sorted(datasets)} and weights {sorted(weights)} name different corpora")
        names = sorted(n for n in datasets if weights[n] > 0)
        if not names or any(w < 0 or not math.isfinite(w) for w in weights.values()):
            raise ValueError(f"weights must be finite, >= 0 and not all zero: {dict(weights)}")
        for n in names:
            if len(datasets[n]) == 0:
                raise ValueError(f"corpus '{n}' is empty but has weight {weights[n]}")
        total_w = sum(weights[n] for n in names)
        self.names = names
        self.datasets = [datasets[n] for n in names]
        self.weights = [weights[n] / total_w for n in names]
        self.sizes = [len(d) for d in self.datasets]
        self.seed = int(seed)
        m = block_size or max(1000, math.ceil(1.0 / min(self.weights)))
        self.block_size = int(m)
        exact = [w * m for w in self.weights]
        counts = [int(math.floor(x)) for x in exact]
        # largest remainder: the block always holds exactly M samples
        for k in sorted(range(len(names)), key=lambda k: exact[k] - counts[k], reverse=True)[: m - sum(counts)]:
            counts[k] += 1
        if any(c == 0 for c in counts):
            raise ValueError(f"block_size {m} too small for weights {self.weights}")
        self.counts = np.array(counts, dtype=np.int64)
        self.bounds = np.cumsum(self.counts)  # block positions [bounds[k-1], bounds[k]) belong to corpus k
        self.num_samples = int(num_samples if num_samples is not None else sum(self.sizes))

    def __len__(self) -> int:
        return self.num_samples

    def locate(self, i: int) -> tuple[str, int]:
        """(corpus name, index inside that corpus) of mixture sample i."""
        if not 0 <= i < self.num_samples:
            raise IndexError(i)
        b, p = divmod(int(i), self.block_size)
        key = int(mix64(np.array([self.seed * 7_919 + b], dtype=np.uint64))[0])
        q = int(FeistelPermutation(self.block_size, key)(p)[0])
        k = int(np.searchsorted(self.bounds, q, side="right"))
        r = q - (int(self.bounds[k - 1]) if k else 0)
        ordinal = b * int(self.counts[k]) + r
        return self.names[k], ordinal % self.sizes[k]

    def __getitem__(self, i: int) -> Any:
        name, j = self.locate(i)
        return self.datasets[self.names.index(name)][j]


def parse_data_mix(data_mix: str | Mapping[str, Any], data_root: Optional[str] = None) -> dict[str, tuple[str, float]]:
    """`--data_mix` -> {name: (data_dir, weight)}.

    Accepted forms (JSON string or dict):
      {"zh_wiki": 0.3, "code": 0.7}                       dirs are <data_root>/<name> (or <name> itself
                                                           when it is an existing folder)
      {"zh_wiki": {"path": "/data/zh_wiki_tokenized", "weight": 0.3}, ...}
    """
    spec = json.loads(data_mix) if isinstance(data_mix, str) else dict(data_mix)
    if not isinstance(spec, dict) or not spec:
        raise ValueError(f"--data_mix must be a non-empty JSON object, got {data_mix!r}")
    out: dict[str, tuple[str, float]] = {}
    for name, v in spec.items():
        if isinstance(v, dict):
            path, w = v.get("path"), v.get("weight")
        else:
            path, w = None, v
        if not isinstance(w, (int, float)) or isinstance(w, bool):
            raise ValueError(f"--data_mix: weight of '{name}' must be a number, got {w!r}")
        if path is None:
            path = os.path.join(data_root, name) if data_root else name
        out[name] = (str(path), float(w))
    return out


def build_pretrain_mixture(data_mix: str | Mapping[str, Any], max_seq_len: int, split: str = "train",
                           seed: int = 0, data_root: Optional[str] = None, use_index: bool = True,
                           num_samples: Optional[int] = None) -> MixtureDataset:
    """A MixtureDataset of pretraining corpora named in `data_mix` (see `parse_data_mix`)."""
    from dataset.dataset_pretrain import PretokDataset, PretokDatasetWithIndex
    parsed = parse_data_mix(data_mix, data_root)
    dsets = {n: (PretokDatasetWithIndex(p, max_seq_len, split) if use_index else PretokDataset(p, max_seq_len))
             for n, (p, _) in parsed.items()}
    return MixtureDataset(dsets, {n: w for n, (_, w) in parsed.items()}, seed=seed, num_samples=num_samples)
